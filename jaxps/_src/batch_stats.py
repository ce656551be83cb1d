"""`sync_batch_stats`: average BatchNorm statistics over the workers."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxps._src import naming
from jaxps.ops import broadcast, push_pull

_COLLECTION = "batch_stats"  # linen's name for BatchNorm's running statistics
_VARIABLES = {"params", _COLLECTION}  # keys that mark linen variables


def sync_batch_stats(tree, *, name: str | None = None):
    """Averages BatchNorm running statistics over all workers.

    `DistributedOptimizer` keeps the parameters equal on every worker, but
    running statistics are updated from each worker's own batches and drift
    apart. Call this before evaluating or saving a model. What is averaged
    depends on `tree`:

    - a flax `nnx.Module`: its `nnx.BatchStat` variables, in place;
    - a flax linen variables dict (a mapping with a ``"params"`` or
      ``"batch_stats"`` key) or a flax struct with such a field (a
      `TrainState`): its ``batch_stats`` only, the rest returned as it is
      (without ``batch_stats``, `tree` itself);
    - any other pytree of arrays, such as ``state.batch_stats`` or
      ``nnx.state(model, nnx.BatchStat)``: all of it.

    Floating leaves become their mean over the workers (one push_pull).
    Other leaves, such as integer counters, bools or PRNG keys, are not
    averaged: they take rank 0's value (one `jaxps.broadcast`) and keep
    their dtype. An empty collection makes no server call. Works eagerly
    and under `jax.jit` and `nnx.jit`; every worker must call it at the
    same point with the same `name`.

    Args:
      tree: an `nnx.Module`, a linen variables dict or struct with
        ``batch_stats``, or a pytree of arrays.
      name: a name unique among the push_pulls that may be in flight at
        once, the same on every worker. Default: the call site, numbered
        within the `jax.jit` trace (as `push_pull`'s).

    Returns:
      None for an `nnx.Module` (updated in place); otherwise a tree like
      `tree` with the averaged statistics.

    Raises:
      TypeError: a leaf is not an array (a linen Module, a string, ...).

    >>> import jax.numpy as jnp, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> jaxps.sync_batch_stats({"mean": jnp.ones(2), "count": jnp.int32(3)})
    {'count': Array(3, dtype=int32), 'mean': Array([1., 1.], dtype=float32)}
    >>> jaxps.shutdown()
    """
    if name is None:
        name = naming.default_name("batch_stats")
    # An nnx.Module can only exist if flax.nnx was imported: no need to
    # import flax for plain pytrees.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(tree, nnx.Module):
        stats = nnx.state(tree, nnx.BatchStat)
        if jax.tree.leaves(stats):
            nnx.update(tree, _average(stats, name))
        return None
    if isinstance(tree, Mapping) and _VARIABLES & set(tree):
        if _COLLECTION not in tree:
            return tree
        stats = _average(tree[_COLLECTION], name)
        return type(tree)({**tree, _COLLECTION: stats})
    if callable(getattr(tree, "replace", None)) and any(
        hasattr(tree, key) for key in _VARIABLES
    ):
        if not hasattr(tree, _COLLECTION):
            return tree
        stats = _average(getattr(tree, _COLLECTION), name)
        return tree.replace(**{_COLLECTION: stats})
    return _average(tree, name)


def _average(tree, name: str):
    """Floating leaves: the workers' mean; other leaves: rank 0's."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in flat:
        _check_leaf(path, leaf)
    leaves = [leaf for _, leaf in flat]
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]
    others = [i for i, x in enumerate(leaves) if not _is_float(x)]
    if floats:
        means = push_pull([leaves[i] for i in floats], name=name)
        for i, mean in zip(floats, means):
            leaves[i] = mean
    if others:
        firsts = broadcast([leaves[i] for i in others], name=f"{name}/rank0")
        for i, first in zip(others, firsts):
            leaves[i] = first
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:  # a Python scalar
        return isinstance(x, float)
    return jnp.issubdtype(dtype, jnp.floating)


def _check_leaf(path, leaf) -> None:
    if isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float):
        return
    what = type(leaf).__name__
    if path:
        what += f" at {jax.tree_util.keystr(path)}"
    hint = ""
    if type(leaf).__module__.startswith("flax.linen"):
        hint = (
            " A linen Module holds no variables: pass the variables dict "
            "from `init` or `state.batch_stats`."
        )
    raise TypeError(
        "sync_batch_stats takes an nnx.Module, a linen variables dict or "
        "struct with batch_stats, or a pytree of arrays; got "
        f"{what}, which is not an array.{hint}"
    )
