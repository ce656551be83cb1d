"""jaxps: BytePS for JAX.

Workers reduce gradients across their local devices, push the shards to CPU
summation servers over gRPC, pull the sums back and run the optimizer
themselves.
"""

# Note: import <name> as <name> is required for names to be exported.
from jaxps import errors as errors
from jaxps._src.config import Config as Config
from jaxps._src.optimizer import DistributedOptimizer as DistributedOptimizer
from jaxps._src.optimizer import DistributedState as DistributedState
from jaxps._src.optimizer import broadcast as broadcast
from jaxps._src.state import init as init
from jaxps._src.state import is_initialized as is_initialized
from jaxps._src.state import push_pull_numpy as push_pull_numpy
from jaxps._src.state import rank as rank
from jaxps._src.state import shutdown as shutdown
from jaxps._src.state import size as size
from jaxps._src.topology import cpu_server_share as cpu_server_share
from jaxps._src.topology import optimal_time as optimal_time
from jaxps.ops import push_pull as push_pull

__version__ = "0.1.0"

__all__ = [
    "Config",
    "DistributedOptimizer",
    "DistributedState",
    "broadcast",
    "cpu_server_share",
    "errors",
    "init",
    "is_initialized",
    "optimal_time",
    "push_pull",
    "push_pull_numpy",
    "rank",
    "shutdown",
    "size",
]
