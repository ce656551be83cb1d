"""Exceptions raised by jaxps."""

from __future__ import annotations


class JaxpsError(RuntimeError):
    """Base class of every jaxps error."""


class ConfigError(JaxpsError, ValueError):
    """A setting is missing or invalid; the message names it."""


class NotInitializedError(JaxpsError):
    """jaxps was used before `jaxps.init()`."""


class RequestRejectedError(JaxpsError, ValueError):
    """A server refused a request (bad dtype, length, rank, round or job)."""


class RoundTimeoutError(JaxpsError, TimeoutError):
    """A round did not complete in time; the message names missing ranks."""


class ServerUnavailableError(JaxpsError, ConnectionError):
    """A summation server could not be reached or stopped answering."""


class ServerRestartedError(JaxpsError):
    """A server restarted mid-job and lost its rounds."""


class MismatchError(RequestRejectedError):
    """Ranks push_pulled different trees (names, shapes or dtypes) under
    one name; the message names both ranks and both trees."""
