"""`broadcast`: one worker's values of a pytree on every worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxps._src import state
from jaxps.ops._push_pull import push_pull


def broadcast(tree, root: int = 0, *, name: str = "broadcast"):
    """Returns `root`'s value of `tree` on every worker.

    Use it once at start-up on the parameters and optimizer state, so every
    worker starts identical. Non-root workers contribute zeros to a sum, so
    the result is exactly `root`'s values (as in BytePS).

    Args:
      tree: a pytree of arrays, with the same structure on every worker.
      root: the rank whose values win.
      name: push_pull name (unique among concurrent push_pulls).

    Returns:
      A pytree like `tree` with `root`'s values.
    """
    size = state.size()
    if not 0 <= root < size:
        raise ValueError(
            f"broadcast root must be in [0, {size}), got root={root}."
        )
    mine = state.rank() == root
    arrays = jax.tree.map(
        lambda x: jnp.asarray(x) if mine else jnp.zeros_like(jnp.asarray(x)),
        tree,
    )
    return push_pull(arrays, average=False, name=name)
