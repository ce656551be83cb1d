"""Errors of jaxps host callbacks, given back by type after `jax.jit`.

When a host callback raises, XLA fails the computation and JAX raises
`jax.errors.JaxRuntimeError`, whose message holds the callback's traceback
as text only: ``except jaxps.errors.JaxpsError`` cannot catch it, and
Python's ``except`` matches by real subclass only, so no class trick can
make it. jaxps's callbacks therefore keep each error they raise in a small
table and append its id to the error's message, the one part of it that
the runtime error's text holds; `typed` finds the id and raises the
original error, chained to the runtime error.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import re
import sys
import threading

_MARK = "jaxps error #"
_FOUND = re.compile(re.escape(_MARK) + r"(\d+)")
_KEEP = 256  # the newest errors; older ones come back as runtime errors

_lock = threading.Lock()
_raised: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_ids = itertools.count(1)


def in_callback(fn):
    """Wraps a host callback so that `typed` can give its errors back."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            _keep(err)
            raise

    return wrapped


def _keep(err: BaseException) -> None:
    with _lock:
        if any(e is err for e, _ in _raised.values()):
            return
        number = next(_ids)
        _raised[number] = (err, err.args)
        while len(_raised) > _KEEP:
            _raised.popitem(last=False)
    # Only the message reaches the runtime error's text (notes do not).
    mark = f" ({_MARK}{number})"
    if err.args and isinstance(err.args[0], str):
        err.args = (err.args[0] + mark, *err.args[1:])
    else:
        err.args = (*err.args, mark.strip())


def original(err: BaseException) -> BaseException | None:
    """The error a jaxps host callback raised that made `err`, or None.

    Args:
      err: an exception, typically a `jax.errors.JaxRuntimeError`.

    Returns:
      The callback's own exception, its message as it was raised, or None
      if `err` did not come from one (or it is too old to be kept).
    """
    # jax is not imported here: servers and the launcher import jaxps.errors
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(err, jax.errors.JaxRuntimeError):
        return None
    with _lock:
        for number in reversed(_FOUND.findall(str(err))):
            found = _raised.get(int(number))
            if found is not None:
                error, args = found
                error.args = args  # without the mark
                return error
    return None


class typed(contextlib.ContextDecorator):
    """Raises jaxps errors from jitted code as their own types.

    Inside ``with jaxps.errors.typed():`` (or on a function decorated with
    ``@jaxps.errors.typed()``), a `jax.errors.JaxRuntimeError` caused by a
    jaxps host callback is replaced by the error that callback raised (for
    example `jaxps.errors.RoundTimeoutError`), chained to the runtime error
    (``__cause__``). Other errors pass unchanged.

    >>> import jax, jaxps
    >>> with jaxps.errors.typed():
    ...     pass
    """

    def __enter__(self):
        return self

    def __exit__(self, typ, value, tb):
        found = None if value is None else original(value)
        if found is None:
            return False
        raise found.with_traceback(None) from value
