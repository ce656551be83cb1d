"""Default push_pull names that never collide, the same on every worker.

A default name is the call site (the first frame outside jaxps and jax:
file name and line) plus, inside a `jax.jit` trace, the call's number among
the calls from that site in the same top-level trace. Two push_pulls of one
jitted step, from two lines or from one helper called twice, thus get two
names, and every worker, tracing the same program, derives the same ones.
Eager calls wait for their sums one after another, so they need no number.

A function jitted on its own and called twice inside another trace is
traced once: its push_pulls have the same names in both calls. Pass
explicit names there.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
import weakref

_lock = threading.Lock()
# top-level trace -> call site -> calls so far from that site in the trace
_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """Directories of jaxps's code (ops/ is installed as jaxps.ops) and of
    jax's, which calls a jitted function from its tracing machinery."""
    import jax
    import jaxlib

    import jaxps
    import jaxps.ops

    return tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for m in (jaxps, jaxps.ops, jax, jaxlib)
    )


def _call_site() -> str:
    own = _own_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(own):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _top_trace():
    """The outermost `jax.jit`-style trace being built, or None (eager)."""
    from jax._src import core  # the trace stack has no public API

    top = None
    trace = core.trace_ctx.trace
    while trace is not None:
        if type(trace).__name__ == "DynamicJaxprTrace":
            top = trace
        trace = getattr(trace, "parent_trace", None)
    return top


def default_name(kind: str) -> str:
    """A name for a call of `kind` (e.g. ``"push_pull"``) from its site."""
    site = f"{kind}@{_call_site()}"
    trace = _top_trace()
    if trace is None:
        return site
    with _lock:
        counts = _counts.setdefault(trace, collections.Counter())
        number = counts[site]
        counts[site] += 1
    return site if number == 0 else f"{site}.{number}"


@contextlib.contextmanager
def unnumbered():
    """Leaves the call numbers of the current trace as they were: for a
    second trace of the same code (a probe) that must not shift the
    names of the real one."""
    trace = _top_trace()
    with _lock:
        saved = None if trace is None else _counts.get(trace, None)
        saved = None if saved is None else collections.Counter(saved)
    try:
        yield
    finally:
        if trace is not None:
            with _lock:
                if saved is None:
                    _counts.pop(trace, None)
                else:
                    _counts[trace] = saved
