"""jaxps: BytePS for JAX.

Workers reduce gradients across their local devices, push the shards to CPU
summation servers over gRPC, pull the sums back and run the optimizer
themselves.
"""

import typing

# Note: import <name> as <name> is required for names to be exported.
from jaxps import errors as errors
from jaxps._src.config import Config as Config
from jaxps._src.join import join as join
from jaxps._src.state import init as init
from jaxps._src.state import is_initialized as is_initialized
from jaxps._src.state import push_pull_numpy as push_pull_numpy
from jaxps._src.state import rank as rank
from jaxps._src.state import shutdown as shutdown
from jaxps._src.state import size as size
from jaxps._src.topology import cpu_server_share as cpu_server_share
from jaxps._src.topology import optimal_time as optimal_time

__version__ = "0.1.0"

# The JAX-facing names are imported on first use, so that `jaxps.servers` and
# `jaxps-launch`, which share this package, start without importing JAX.
_LAZY = {
    "compression": "jaxps._src.compression",
    "elastic": "jaxps.elastic",
    "AsyncDistributedOptimizer": "jaxps._src.optimizer",
    "AsyncState": "jaxps._src.optimizer",
    "DistributedOptimizer": "jaxps._src.optimizer",
    "DistributedState": "jaxps._src.optimizer",
    "SyncGradientsState": "jaxps._src.optimizer",
    "sync_gradients": "jaxps._src.optimizer",
    "sync_batch_stats": "jaxps._src.batch_stats",
    "broadcast": "jaxps.ops",
    "push_pull": "jaxps.ops",
    "value_and_grad": "jaxps.ops",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxps' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(module)
    value = module if module.__name__.endswith(name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if typing.TYPE_CHECKING:  # the lazy names, for type checkers and readers
    from jaxps._src.batch_stats import sync_batch_stats  # noqa: F401
    from jaxps._src.optimizer import (  # noqa: F401
        AsyncDistributedOptimizer,
        AsyncState,
        DistributedOptimizer,
        DistributedState,
        SyncGradientsState,
        sync_gradients,
    )
    from jaxps.ops import broadcast, push_pull, value_and_grad  # noqa: F401

__all__ = [
    "AsyncDistributedOptimizer",
    "AsyncState",
    "Config",
    "DistributedOptimizer",
    "DistributedState",
    "SyncGradientsState",
    "broadcast",
    "compression",
    "cpu_server_share",
    "elastic",
    "errors",
    "init",
    "is_initialized",
    "join",
    "optimal_time",
    "push_pull",
    "push_pull_numpy",
    "rank",
    "shutdown",
    "size",
    "sync_batch_stats",
    "sync_gradients",
    "value_and_grad",
]
