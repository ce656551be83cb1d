"""The process-wide runtime behind `jaxps.init()` and friends."""

from __future__ import annotations

import atexit
import threading
from typing import Any

import numpy as np

from jaxps._src import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime

_lock = threading.Lock()
_runtime: Runtime | None = None


def _check_platforms() -> None:
    """Fails if JAX was told to run without its CPU platform.

    jaxps's host callbacks run on the host beside the accelerator: JAX's
    GPU callback needs the CPU client (``JAX_PLATFORMS=cuda`` alone makes
    every push_pull fail when it runs). Checked here, before any backend
    starts, so that the error comes at once.
    """
    import jax

    platforms = jax.config.jax_platforms
    if not platforms:
        return  # JAX's default: every platform found, the CPU among them
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    if "cpu" in names:
        return
    raise errors.ConfigError(
        f"JAX_PLATFORMS={platforms!r} leaves out the CPU platform, which "
        "jaxps's host callbacks need beside the accelerator. Keep it: "
        f"JAX_PLATFORMS={','.join(names + ['cpu'])!r}."
    )


def init(config: Config | None = None, **settings: Any) -> Config:
    """Connects this worker to the summation servers.

    Settings come from `config`, else from keyword arguments, then from the
    ``JAXPS_*`` environment variables (see `jaxps.Config`). Calling `init`
    again with the same settings is a no-op.

    Args:
      config: a complete `jaxps.Config`; excludes keyword settings.
      **settings: fields of `jaxps.Config` (``servers``, ``num_workers``,
        ``worker_rank``, ``partition_bytes``, ``timeout``, ...).

    Returns:
      The config in effect.
    """
    global _runtime
    _check_platforms()
    if config is not None and settings:
        raise errors.ConfigError(
            "pass either config= or keyword settings to jaxps.init, not both."
        )
    if config is None:
        config = Config.from_env(**settings)
    with _lock:
        if _runtime is not None:
            if _runtime.config == config:
                return config
            raise errors.ConfigError(
                "jaxps.init was already called with other settings; call "
                "jaxps.shutdown() first."
            )
        _runtime = Runtime(config)
    return config


def shutdown() -> None:
    """Disconnects from the servers; `init` may be called again after."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.close()


atexit.register(shutdown)


def runtime() -> Runtime:
    """The initialized runtime, or a `NotInitializedError`."""
    r = _runtime
    if r is None:
        raise errors.NotInitializedError(
            "jaxps is not initialized: call jaxps.init() first."
        )
    return r


def is_initialized() -> bool:
    """Whether `jaxps.init()` has been called (and not shut down)."""
    return _runtime is not None


def rank() -> int:
    """This worker's rank in ``[0, size())``."""
    return runtime().rank


def size() -> int:
    """The number of workers in the job."""
    return runtime().size


def push_pull_numpy(name: str, array, *, average: bool = True) -> np.ndarray:
    """Sums a numpy array over all workers, outside of JAX tracing.

    Args:
      name: a name unique to this tensor, the same on every worker.
      array: the local contribution (a supported dtype, any shape).
      average: divide the sum by `size()`.

    Returns:
      A new array with the sum (or mean) over all workers.

    >>> import jaxps, numpy as np
    >>> jaxps.init(num_workers=1)
    >>> jaxps.push_pull_numpy("x", np.ones(3, np.float32))
    array([1., 1., 1.], dtype=float32)
    >>> jaxps.shutdown()
    """
    return runtime().push_pull(name, array, average=average)
