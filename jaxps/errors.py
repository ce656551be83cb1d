"""Exceptions raised by jaxps (all derive from `JaxpsError`)."""

from jaxps._src.errors import ConfigError as ConfigError
from jaxps._src.errors import JaxpsError as JaxpsError
from jaxps._src.errors import NotInitializedError as NotInitializedError
from jaxps._src.errors import RequestRejectedError as RequestRejectedError
from jaxps._src.errors import RoundTimeoutError as RoundTimeoutError
from jaxps._src.errors import ServerRestartedError as ServerRestartedError
from jaxps._src.errors import ServerUnavailableError as ServerUnavailableError

__all__ = [
    "ConfigError",
    "JaxpsError",
    "NotInitializedError",
    "RequestRejectedError",
    "RoundTimeoutError",
    "ServerRestartedError",
    "ServerUnavailableError",
]
