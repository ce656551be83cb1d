"""`value_and_grad`: gradients pushed while the backward pass still runs.

Each differentiated leaf goes through an identity with a custom VJP (a
*tap*). Its backward rule runs as soon as that leaf's cotangent is complete:
it starts the leaf's push_pull (the start host callback) and hands the
callback's ticket back as the cotangent of a scalar *slot* input, so the
ticket leaves the backward pass as data. After the backward pass one done
callback, which takes every ticket, waits for the sums. The leaf's own
cotangent is zero: its sum, not its local gradient, is the result.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jaxps._src import jit_errors, naming, plan, state
from jaxps.ops import _callback, _host, _sharded
from jaxps.ops._push_pull import gathered, leaf_names, local_piece, push_pull


def _start(names, average, priorities, mode, shard, *grads, **crossing):
    # A bucket's call check is named after its first leaf: the default, the
    # user's name alone, is the same for every bucket of several leaves, and
    # the buckets of one step are in flight at once. A float32 holds every
    # ticket exactly (they stay below _host.TICKETS).
    ticket = _host.start(
        names,
        average,
        priorities,
        mode,
        shard,
        *grads,
        call=plan.call_name(names[:1]),
        **crossing,
    )
    return np.float32(ticket)


def _done_all(*tickets):
    # every leaf's sum; the first error fails the step, the rest are waited
    # for too, so that no push is left in flight
    sums, first = [], None
    for ticket in tickets:
        try:
            sums.extend(_host.done(int(ticket)))
        except Exception as err:  # noqa: BLE001 - raised below
            first = first or err
    if first is not None:
        raise first
    return tuple(sums)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tap(leaves, slot, spec):
    del slot, spec
    return leaves


def _tap_fwd(leaves, slot, spec):
    del slot, spec
    return leaves, None


def _tap_bwd(spec, _, cotangents):
    """Starts the push of a bucket once all its cotangents are complete."""
    names, average, priorities, axis_name = spec
    shard, pushed = jnp.int32(0), list(cotangents)
    if axis_name is not None:  # this device pushes its 1/L of the local sum
        shard = lax.axis_index(axis_name).astype(jnp.int32)
        pushed = [local_piece(c, axis_name) for c in cotangents]
        # the runtime divides by the ranks that pushed; _collect by local
    # the program runs on the default backend: cross as its callbacks do
    operands, layout = _host.fuse(pushed, (jax.default_backend(),), names)
    ticket = _callback.call(
        jit_errors.in_callback(
            functools.partial(
                _start,
                names,
                average,
                priorities,
                "sync",
                layout=layout,
                from_callback=True,
            )
        ),
        jax.ShapeDtypeStruct((), jnp.float32),
        shard,
        *operands,
        per_device=names[0],
    )
    return tuple(jnp.zeros_like(c) for c in cotangents), ticket


_tap.defvjp(_tap_fwd, _tap_bwd)


def _buckets(leaves, specs, bucket_bytes):
    """Pushed leaves of consecutive priority (highest first), grouped up to
    `bucket_bytes` each: a bucket's leaves get their gradients at about the
    same time of the backward pass."""
    pushed = [i for i, spec in enumerate(specs) if spec is not None]
    pushed.sort(key=lambda i: (-specs[i][1], i))
    buckets, current, size = [], [], 0
    for i in pushed:
        current.append(i)
        size += (
            np.prod(jnp.shape(leaves[i])) * jnp.result_type(leaves[i]).itemsize
        )
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _use_order(fun_of_leaves, leaves):
    """Leaf indices in the order `fun_of_leaves` first uses them (unused
    leaves last), from a probe trace of it; None if the probe fails, the
    real trace then reports the error."""
    try:
        with naming.unnumbered():
            jaxpr = jax.make_jaxpr(fun_of_leaves)(list(leaves)).jaxpr
    except Exception:  # noqa: BLE001 - e.g. a mutation nnx refuses here
        return None
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    first: dict[int, int] = {}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal) and v in index:
                first.setdefault(index[v], n)
    unused = len(jaxpr.eqns)
    return sorted(range(len(leaves)), key=lambda i: (first.get(i, unused), i))


def _tap_all(leaves, slots, specs, buckets, average, axis_name):
    """`leaves` with each bucket passed through one tap."""
    out = list(leaves)
    for bucket, slot in zip(buckets, slots):
        spec = (
            tuple(specs[i][0] for i in bucket),
            average,
            tuple(specs[i][1] for i in bucket),
            axis_name,
        )
        for i, leaf in zip(
            bucket, _tap(tuple(out[i] for i in bucket), slot, spec)
        ):
            out[i] = leaf
    return out


def _padded(leaf, local):
    flat = jnp.ravel(leaf)
    return jnp.pad(flat, (0, -flat.size % local))


def value_and_grad(
    fun,
    argnums: int = 0,
    has_aux: bool = False,
    *,
    average: bool = True,
    name: str | None = None,
    priorities=None,
    axis_name=None,
    bucket_bytes: int = 1 << 20,
    mesh=None,
):
    """`jax.value_and_grad` whose gradients are summed over the workers.

    The leaves go out in buckets (leaves of consecutive priority, by
    default of consecutive use in `fun`, about `bucket_bytes` each). Each
    bucket's push_pull starts inside the backward pass, as soon as its
    gradients are complete, so communication overlaps the rest of the
    backward pass; the sums are waited for at the end, by one host
    callback. The result equals
    ``push_pull(jax.grad(fun)(...))`` bit for bit (with deterministic
    servers). Use it with the optimizer itself (``optax.adamw(...)``, or
    ``nnx.Optimizer`` with it), not with `DistributedOptimizer`, which would
    average again. `fun` may take an `nnx.Module` as its differentiated
    argument: the gradients are those of its `nnx.Param` variables, as
    `nnx.value_and_grad` gives them.

    Inside shard_map or pmap over the host's local devices pass that axis
    as `axis_name`: each gradient is reduce-scattered over the local
    devices in the backward pass, each device pushes its own shard, and the
    sums are all-gathered back (as `push_pull`'s hierarchical path).

    Under a `jax.jit` sharded over a mesh of the host's devices (see
    `push_pull`'s `mesh`), the gradients are computed whole, then pushed
    as `push_pull` does on a mesh (each device its own slice): the push
    does not overlap the backward pass there.

    Not covered (use `DistributedOptimizer`): ``backward_passes_per_step``
    (local accumulation) and compression.

    Args:
      fun: the loss; returns a scalar (and an aux value if `has_aux`).
      argnums: the one positional argument to differentiate.
      has_aux: `fun` returns ``(loss, aux)``.
      average: average (rather than sum) the gradients over workers.
      name: push_pull name of the gradients. Default: the call site,
        numbered within the `jax.jit` trace (as `push_pull`'s).
      priorities: one int per leaf, higher goes out first. Default: the
        leaves `fun` uses first go out first (the first layers, which the
        next forward pass needs first), from a probe trace of `fun`; the
        tree's order if that trace fails.
      axis_name: the shard_map / pmap axis of the local devices, or None.
      bucket_bytes: leaves of consecutive priority are pushed together, in
        buckets of about this many bytes; a bucket's push starts once all
        of its gradients are complete. Small buckets start sooner, but
        every push costs CPU (a host callback, a round per server).
      mesh: the mesh of a sharded `jax.jit`, as `push_pull`'s.

    Returns:
      A function with `fun`'s arguments that returns ``(value, grads)``
      (``((value, aux), grads)`` with `has_aux`).

    >>> import jax.numpy as jnp, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> loss = lambda p: jnp.sum(p["w"] ** 2)
    >>> jaxps.value_and_grad(loss)({"w": jnp.ones(2)})
    (Array(2., dtype=float32), {'w': Array([2., 2.], dtype=float32)})
    >>> jaxps.shutdown()
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f"bucket_bytes must be an int, got {bucket_bytes!r}.")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}.")
    if not isinstance(argnums, int):
        raise TypeError(
            "jaxps.value_and_grad differentiates one argument: argnums must "
            f"be an int, got {argnums!r}."
        )

    def wrapped(*args, **kwargs):
        if not -len(args) <= argnums < len(args):
            raise ValueError(
                f"argnums={argnums} but the function got {len(args)} "
                "positional arguments."
            )
        runtime = state.runtime()  # at trace time if not initialized
        runtime.check_mode((), "sync")
        base = name if name is not None else naming.default_name("grads")
        target = args[argnums]
        nnx = sys.modules.get("flax.nnx")
        if axis_name is None:
            _sharded.check_manual((base,), axis_name)
            host_mesh = _sharded.mesh_of(_param_leaves(nnx, target), mesh)
            if host_mesh is not None:
                grad = jax.value_and_grad
                if nnx is not None and isinstance(target, nnx.Module):
                    grad = nnx.value_and_grad
                value, grads = grad(fun, argnums=argnums, has_aux=has_aux)(
                    *args, **kwargs
                )
                return value, push_pull(
                    grads,
                    average=average,
                    name=base,
                    priorities=priorities,
                    mesh=host_mesh,
                )
        if nnx is not None and isinstance(target, nnx.Module):
            return _module_value_and_grad(
                nnx,
                fun,
                argnums,
                has_aux,
                args,
                kwargs,
                base,
                average,
                axis_name,
                bucket_bytes,
            )
        leaves, treedef = jax.tree.flatten(target)
        index = argnums % len(args)

        def probe(flat):
            call = list(args)
            call[index] = treedef.unflatten(flat)
            return fun(*call, **kwargs)

        order = None if priorities is not None else _use_order(probe, leaves)
        specs = _specs(target, base, priorities, order)
        buckets = _buckets(leaves, specs, bucket_bytes)
        slots = [jnp.zeros((), jnp.float32) for _ in buckets]

        def tapped(tree, slots, *rest):
            taps = _tap_all(
                jax.tree.leaves(tree), slots, specs, buckets, average, axis_name
            )
            call = list(rest)
            call.insert(index, treedef.unflatten(taps))
            return fun(*call, **kwargs)

        rest = [a for i, a in enumerate(args) if i != index]
        value, (grads, tickets) = jax.value_and_grad(
            tapped, argnums=(0, 1), has_aux=has_aux
        )(target, slots, *rest)
        return value, _collect(
            grads, tickets, specs, buckets, average, axis_name
        )

    return wrapped


def _param_leaves(nnx, target):
    if nnx is not None and isinstance(target, nnx.Module):
        return jax.tree.leaves(nnx.state(target, nnx.Param))
    return jax.tree.leaves(target)


def _specs(tree, base, priorities, order):
    """Per leaf: (wire name, priority), or None (an empty leaf). Without
    `priorities`, the leaves the forward pass uses first (`order`, or the
    tree's order) go out first: the next forward pass needs them first."""
    leaves = jax.tree.leaves(tree)
    count = len(leaves)
    if priorities is None:
        priorities = [0] * count
        for position, i in enumerate(order or range(count)):
            priorities[i] = -position
    priorities = [int(p) for p in priorities]
    if len(priorities) != count:
        raise ValueError(
            f"value_and_grad got {len(priorities)} priorities for {count} "
            "leaves."
        )
    specs = []
    for leaf_name, leaf, priority in zip(
        leaf_names(tree, base), leaves, priorities
    ):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                f"value_and_grad of {leaf_name}: gradients need floating "
                "leaves."
            )
        empty = not np.prod(jnp.shape(leaf))
        specs.append(None if empty else (leaf_name, priority))
    return specs


def _collect(grads, tickets, specs, buckets, average, axis_name):
    """The summed gradients, from one done callback for all the buckets.

    One callback that takes every ticket cannot run before the last start:
    with a done per leaf, XLA ran each right after its leaf's start, so the
    backward pass waited for one round trip after another (and blocked
    dones could hold every thread of the CPU runtime).
    """
    leaves, treedef = jax.tree.flatten(grads)
    if not buckets:
        return grads
    # per bucket: the shapes its start pushed, and their operands (as
    # `_tap_bwd` made them: one per dtype where the leaves were fused)
    layouts, results = [], []
    for bucket in buckets:
        pushed = []
        for i in bucket:
            shape = leaves[i].shape
            if axis_name is not None:
                local = lax.axis_size(axis_name)
                shape = (_padded(leaves[i], local).size // local,)
            pushed.append(jax.ShapeDtypeStruct(shape, leaves[i].dtype))
        layout = _host.layout_of(
            [specs[i][0] for i in bucket], pushed, (jax.default_backend(),)
        )
        layouts.append(layout)
        results += (
            pushed
            if layout is None
            else [jax.ShapeDtypeStruct(*o) for o in layout.operand_shapes]
        )
    sums = iter(
        _callback.call(
            jit_errors.in_callback(_done_all), tuple(results), *tickets
        )
    )
    outs = list(leaves)  # empty leaves stay as they are
    for bucket, layout in zip(buckets, layouts):
        if layout is None:
            mine = [next(sums) for _ in bucket]
        else:
            mine = layout.unfuse([next(sums) for _ in layout.groups])
        for i, out in zip(bucket, mine):
            if axis_name is not None:
                if average:
                    out = out / jnp.asarray(local, out.dtype)
                out = gathered(out, axis_name)
                out = out[: leaves[i].size].reshape(leaves[i].shape)
            outs[i] = out
    return treedef.unflatten(outs)


def _module_value_and_grad(
    nnx,
    fun,
    argnums,
    has_aux,
    args,
    kwargs,
    base,
    average,
    axis_name,
    bucket_bytes,
):
    """`value_and_grad` of an `nnx.Module` argument, by its `nnx.Param`s."""
    module = args[argnums]
    params = nnx.state(module, nnx.Param)
    leaves, params_def = jax.tree.flatten(params)

    def probe(flat):  # on a copy: what the probe's forward changes is lost
        copy = nnx.clone(module)
        nnx.update(copy, params_def.unflatten(flat))
        call = list(args)
        call[argnums] = copy
        return fun(*call, **kwargs)

    specs = _specs(params, base, None, _use_order(probe, leaves))
    buckets = _buckets(leaves, specs, bucket_bytes)
    slots = [jnp.zeros((), jnp.float32) for _ in buckets]

    def tapped(module, slots):
        inner = nnx.state(module, nnx.Param)
        flat, treedef = jax.tree.flatten(inner)
        taps = _tap_all(flat, slots, specs, buckets, average, axis_name)
        nnx.update(module, treedef.unflatten(taps))
        call = list(args)
        call[argnums] = module
        return fun(*call, **kwargs)

    value, (grads, tickets) = nnx.value_and_grad(
        tapped, argnums=(0, 1), has_aux=has_aux
    )(module, slots)
    return value, _collect(grads, tickets, specs, buckets, average, axis_name)
