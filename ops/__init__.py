"""The JAX side of jaxps (``jaxps.ops``).

`push_pull` is a JAX primitive (``jaxps_push_pull``) that lowers to a pair of
XLA host callbacks: a start that hands the arrays to the worker runtime and a
done that waits for the sums. `broadcast` hands one worker's values to all
of them through the same primitive. `value_and_grad` starts each gradient's
push inside the backward pass.
"""

from jaxps.ops._broadcast import broadcast as broadcast
from jaxps.ops._overlap import value_and_grad as value_and_grad
from jaxps.ops._primitive import push_pull_p as push_pull_p
from jaxps.ops._push_pull import push_pull as push_pull

# push_pull_p (the Primitive object) is importable for transformation
# authors, but not part of the documented surface.
__all__ = ["broadcast", "push_pull", "value_and_grad"]
