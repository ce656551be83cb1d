"""push_pull on a host with several devices, from a sharded `jax.jit`.

Under a jit over a mesh of the host's devices (``jax.set_mesh``, inputs
placed with a `NamedSharding`, or ``mesh=``), the gradients are already the
host's sums: XLA reduced them over the batch axes. `push_pull` then runs in
a ``shard_map`` over every axis of that mesh, so that each device pushes only
its own slice of its own block, runs its own host callbacks, and gets the
sums back by an ``all_gather`` over the devices that share the block. The
result has the leaf's sharding; nothing is left on one device.

A leaf's block comes from its type where the mesh's axes are explicit
(``jax.typeof(x).sharding.spec``, e.g. ``P(None, "model")`` on a data x model
mesh: each device pushes a slice of its own model shard). Where the axes are
``Auto``, the layout is XLA's to choose and is unknown when jaxps traces:
the leaf is then taken replicated (what a gradient of a replicated
parameter is), so each device pushes 1/L of it and the sum comes back
replicated, which XLA slices at no cost for parameters sharded otherwise.
That costs an all-reduce on the host where a reduce-scatter would do (the
block path's cost too); the network carries 1/L per device either way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import sharding_impls
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxps.ops import _primitive


def _abstract(mesh):
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return mesh
    return mesh.abstract_mesh


def _multi(mesh) -> bool:
    return mesh is not None and not mesh.empty and mesh.size > 1


def check_manual(names, axis_name) -> None:
    """Raises if a push_pull inside shard_map/pmap cannot place itself."""
    context = jax.sharding.get_abstract_mesh()
    manual = [a for a in context.manual_axes if context.shape[a] > 1]
    if not manual or axis_name is not None:
        return
    raise ValueError(
        f"push_pull of {names[0]!r} runs inside shard_map or pmap over the "
        f"axes {tuple(manual)} (sizes {[context.shape[a] for a in manual]}) "
        "without axis_name: every device would push its own copy under the "
        f"same name. Pass the local device axis, axis_name={manual[0]!r}, so "
        "that the devices reduce-scatter first and each pushes its own slice."
    )


def mesh_of(leaves, mesh=None):
    """The host mesh a push_pull of `leaves` runs on, or None.

    In order: `mesh`; the mesh of the leaves' shardings (a concrete array's,
    or a traced value's type where the mesh's axes are explicit); the mesh
    in context (``jax.set_mesh``). None means one device, or a jit whose
    devices only its lowering knows (see `lowering_mesh`).
    """
    context = jax.sharding.get_abstract_mesh()
    if context.manual_axes:
        if set(context.manual_axes) != set(context.axis_names):
            raise ValueError(
                "push_pull inside a shard_map that is manual over only "
                f"{tuple(context.manual_axes)} of the mesh axes "
                f"{tuple(context.axis_names)}: host callbacks need every "
                "axis manual. Leave axis_names at its default (all axes)."
            )
        return None
    if mesh is not None:
        if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
            raise TypeError(
                f"push_pull mesh must be a jax.sharding.Mesh, got {mesh!r} "
                f"of type {type(mesh)}."
            )
        return _checked(mesh)
    for leaf in leaves:
        found = _leaf_mesh(leaf)
        if _multi(found):
            return _checked(found)
    if _multi(context):
        return _checked(context)
    return None


def _leaf_mesh(leaf):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = leaf.sharding
        return getattr(sharding, "mesh", None)
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    found = getattr(sharding, "mesh", None)
    if found is None or found.empty or not found.explicit_axes:
        return None
    return found


def _checked(mesh):
    if mesh.size > jax.local_device_count():
        raise ValueError(
            f"push_pull got a mesh of {mesh.size} devices ({mesh}), more "
            f"than this process's {jax.local_device_count()}: jaxps sums "
            "across workers itself. Give each worker process a mesh of its "
            "own local devices (jax.local_devices())."
        )
    return mesh


def _spec(leaf, mesh):
    """The leaf's PartitionSpec over `mesh` if its type says, else None."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        sharding = leaf.sharding
    spec = getattr(sharding, "spec", None)
    found = getattr(sharding, "mesh", None)
    if spec is None or found is None or found.empty:
        return None
    explicit = _abstract(found).explicit_axes
    if not explicit and not isinstance(leaf, jax.Array):
        return None
    if tuple(found.axis_names) != tuple(_abstract(mesh).axis_names):
        return None
    return P(*spec, *([None] * (jnp.ndim(leaf) - len(spec))))


def _used_axes(spec) -> set[str]:
    used = set()
    for entry in spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


def _tag(mesh, spec) -> str:
    """The layout part of a leaf's wire name.

    A replicated leaf is cut the same way on any mesh of L devices (slice i
    on the device of linear index i), however jaxps found the mesh: its
    tag names L only, so that ranks that found it differently (a value's
    type on one, the jit's devices on another) still meet. A sharded leaf's
    slices depend on the mesh's shape and the spec: its tag names both.
    """
    abstract = _abstract(mesh)
    if not _used_axes(spec):
        return f"/devices{abstract.size}"
    shape = ",".join(f"{a}={n}" for a, n in abstract.shape.items())
    return f"/mesh({shape}){spec}"


def push_pull(leaves, names, priorities, average, mode, mesh):
    """The sums of `leaves`, each device pushing its slice; see module doc."""
    abstract = _abstract(mesh)
    axes = tuple(abstract.axis_names)
    specs = [_spec(leaf, mesh) or P() for leaf in leaves]
    tagged = tuple(f"{n}{_tag(mesh, s)}" for n, s in zip(names, specs))

    def body(*blocks):
        shard = lax.axis_index(axes).astype(jnp.int32)
        pieces, layouts = [], []
        for block, spec in zip(blocks, specs):
            # the devices that hold the same block push a slice each
            shared = tuple(a for a in axes if a not in _used_axes(spec))
            count = math.prod(abstract.shape[a] for a in shared)
            flat = jnp.ravel(block)
            width = -(-flat.size // count)
            flat = jnp.pad(flat, (0, width * count - flat.size))
            if shared:
                index = lax.axis_index(shared)
                flat = lax.dynamic_slice_in_dim(flat, index * width, width)
            pieces.append(flat)
            layouts.append((shared, block.shape, block.size))
        sums = _primitive.bind(
            pieces,
            shard,
            names=tagged,
            average=average,
            priorities=priorities,
            mode=mode,
        )
        outs = []
        for total, (shared, shape, size) in zip(sums, layouts):
            if shared:
                total = lax.all_gather(total, shared, tiled=True)
            outs.append(total[:size].reshape(shape))
        return tuple(outs)

    return list(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=tuple(specs),
            check_vma=False,
        )(*leaves)
    )


def lowering_mesh(ctx):
    """A 1-D mesh over the devices of a jit being lowered, or None.

    A push_pull traced without a mesh (an ``Auto``-axis mesh not in
    context: JAX decides the layout only when it compiles) learns at
    lowering that the program spans several devices; it then lowers as a
    push_pull on this mesh.
    """
    context = ctx.module_context.axis_context
    if not isinstance(context, sharding_impls.ShardingContext):
        return None
    if context.num_devices <= 1:
        return None
    devices = np.empty(context.num_devices, dtype=object)
    # lowering is device-agnostic: positions, not ids, place the slices
    devices[:] = list(
        context.device_assignment or jax.local_devices()[: context.num_devices]
    )
    return Mesh(devices, ("devices",), axis_types=(AxisType.Auto,))
