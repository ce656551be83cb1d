"""Exceptions raised by jaxps (all derive from `JaxpsError`).

Inside `jax.jit`, a jaxps error reaches the caller as JAX's
`jax.errors.JaxRuntimeError`; `typed` (a context manager and decorator)
raises it as its own type again.
"""

from jaxps._src.errors import ConfigError as ConfigError
from jaxps._src.errors import JaxpsError as JaxpsError
from jaxps._src.errors import MismatchError as MismatchError
from jaxps._src.errors import NotInitializedError as NotInitializedError
from jaxps._src.errors import RequestRejectedError as RequestRejectedError
from jaxps._src.errors import RoundTimeoutError as RoundTimeoutError
from jaxps._src.errors import ServerRestartedError as ServerRestartedError
from jaxps._src.errors import ServerUnavailableError as ServerUnavailableError
from jaxps._src.jit_errors import original as original
from jaxps._src.jit_errors import typed as typed

__all__ = [
    "ConfigError",
    "JaxpsError",
    "MismatchError",
    "NotInitializedError",
    "RequestRejectedError",
    "RoundTimeoutError",
    "ServerRestartedError",
    "ServerUnavailableError",
    "original",
    "typed",
]
