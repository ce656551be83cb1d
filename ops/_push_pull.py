"""`push_pull`: sum a pytree over all workers, from inside JAX programs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config

from jaxps._src import naming, state
from jaxps.ops import _primitive, _sharded


def leaf_names(tree, name: str) -> tuple[str, ...]:
    """Stable per-leaf names: `name`, the leaf's path, dtype and shape."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return tuple(
        f"{name}{jax.tree_util.keystr(path)}:{jnp.result_type(leaf)}"
        f"{list(jnp.shape(leaf))}"
        for path, leaf in leaves
    )


def push_pull(
    tree,
    *,
    average: bool = True,
    name: str | None = None,
    axis_name=None,
    priorities=None,
    mode: str = "sync",
    mesh=None,
):
    """Sums (or averages) every leaf of `tree` over all workers.

    Works eagerly and under `jax.jit`, `jax.grad` (it is linear), `jax.vmap`,
    `jax.shard_map` and `jax.pmap`. Under a `jax.jit` sharded over a mesh
    of the host's devices (see `mesh`), each device pushes its own slice of
    the host's sum and the results keep their sharding. Inside shard_map or
    pmap, pass the local device axis as `axis_name`: the leaves are first
    reduce-scattered over the local devices, each device pushes its own
    shard, and the sums are all-gathered back, so every device ends up with
    the global result.

    Empty leaves (a zero in their shape) come back as they are, without
    any traffic. A leaf's name includes its shape and dtype, so a new shape
    (a last, smaller batch) is a new tensor on the wire, not an error.

    Args:
      tree: a pytree of arrays (float32, float64, float16, bfloat16, int32,
        int64).
      average: divide by the number of contributions (workers, times local
        devices when `axis_name` is given). Needs floating dtypes.
      name: a name unique among the push_pulls that may be in flight at once,
        the same on every worker; leaf paths are appended to it. Default:
        the call site (file and line) numbered within the `jax.jit` trace,
        so that two push_pulls of one step never collide (see `name` in
        docs/usage.md).
      axis_name: the shard_map / pmap axis of the local devices, or None.
        Required inside a shard_map or pmap over more than one device.
      priorities: one int per leaf; higher goes out first. Default: leaves
        earlier in the tree first.
      mode: ``"sync"`` (the servers sum) or ``"async"`` (servers started
        with ``--async``, which hold parameters: each push is added into
        them and the pull returns the latest; `AsyncDistributedOptimizer`
        uses it). A mode that does not match the servers' is an error.
      mesh: the `jax.sharding.Mesh` of this host's devices that a sharded
        `jax.jit` runs on. Default: the mesh of the leaves' shardings (where
        its axes are explicit), else the mesh in context (`jax.set_mesh`).
        On a mesh, each device pushes only its own slice of the (already
        host-reduced) leaves, and the sums keep the leaves' sharding.

    Returns:
      A pytree like `tree` with the sums (or means).

    >>> import jax.numpy as jnp, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> jaxps.push_pull({"w": jnp.ones(2)})
    {'w': Array([1., 1.], dtype=float32)}
    >>> jaxps.shutdown()
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    runtime = state.runtime()  # fail at trace time if not initialized
    if name is None:
        name = naming.default_name("push_pull")
    names = leaf_names(tree, name)
    runtime.check_mode(names, mode)  # at trace time, not inside a callback
    if axis_name is None:
        _sharded.check_manual(names, axis_name)
    if priorities is None:
        priorities = [-i for i in range(len(leaves))]
    priorities = tuple(int(p) for p in priorities)
    if len(priorities) != len(leaves):
        raise ValueError(
            f"push_pull got {len(priorities)} priorities for "
            f"{len(leaves)} leaves."
        )
    for n, leaf in zip(names, leaves):
        if average and not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                f"push_pull of {n}: average=True needs a floating "
                "dtype; pass average=False to sum integers."
            )
    # empty leaves have nothing to sum: they come back as they are
    outs = [None if math.prod(jnp.shape(x)) else jnp.asarray(x) for x in leaves]
    live = [i for i, out in enumerate(outs) if out is None]
    if live:
        live_leaves = [leaves[i] for i in live]
        live_names = tuple(names[i] for i in live)
        live_priorities = tuple(priorities[i] for i in live)
        host_mesh = None
        if axis_name is None:
            host_mesh = _sharded.mesh_of(live_leaves, mesh)
        if host_mesh is not None:
            sums = _sharded.push_pull(
                live_leaves,
                live_names,
                live_priorities,
                average,
                mode,
                host_mesh,
            )
        elif axis_name is None:
            sums = _primitive.bind(
                live_leaves,
                jnp.int32(0),
                names=live_names,
                average=average,
                priorities=live_priorities,
                mode=mode,
            )
        else:
            sums = _hierarchical(
                live_leaves,
                live_names,
                live_priorities,
                axis_name,
                average,
                mode,
            )
        for i, out in zip(live, sums):
            outs[i] = out
    return jax.tree_util.tree_unflatten(treedef, outs)


def _varying(x) -> frozenset:
    """The manual axes along which `x` varies (its type's vma)."""
    aval = jax.typeof(x)
    found = getattr(aval, "vma", None)  # jax >= 0.11
    if found is None:  # jax 0.10: the manual axis type's varying axes
        found = aval.mat.varying
    return frozenset(found)


def local_piece(x, axis_name):
    """This device's 1/L of `x` summed over the local devices, flat.

    A varying `x` (each device's own value) is reduce-scattered. An
    invariant one, which shard_map's check_vma (the default) knows to be
    the same on every device, is already that sum: the gradient of a
    replicated input comes out of `jax.grad` summed over the axis. It is
    sliced, not summed again.
    """
    local = lax.axis_size(axis_name)
    flat = jnp.ravel(x)
    flat = jnp.pad(flat, (0, -flat.size % local))
    if not config._check_vma.value or axis_name in _varying(flat):
        return lax.psum_scatter(flat, axis_name, tiled=True)
    width = flat.size // local
    start = lax.axis_index(axis_name) * width
    return lax.dynamic_slice_in_dim(flat, start, width)


def gathered(piece, axis_name):
    """The pieces of every local device, concatenated, on every device."""
    if config._check_vma.value and axis_name not in _varying(piece):
        piece = lax.pcast(piece, axis_name, to="varying")
    return lax.all_gather(piece, axis_name, tiled=True, to="invarying")


def _hierarchical(leaves, names, priorities, axis_name, average, mode):
    local = lax.axis_size(axis_name)
    index = lax.axis_index(axis_name).astype(jnp.int32)
    shards = [local_piece(leaf, axis_name) for leaf in leaves]
    pads = [-math.prod(jnp.shape(leaf)) % local for leaf in leaves]
    sums = _primitive.bind(
        shards,
        index,
        names=names,
        average=average,  # by the ranks that pushed (fewer after join)
        priorities=priorities,
        mode=mode,
    )
    outs = []
    for leaf, total, pad in zip(leaves, sums, pads):
        if average:
            total = total / jnp.asarray(local, total.dtype)
        full = gathered(total, axis_name)
        if pad:
            full = full[: full.size - pad]
        outs.append(full.reshape(jnp.shape(leaf)))
    return outs
