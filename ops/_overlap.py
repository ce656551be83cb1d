"""`value_and_grad`: gradients pushed while the backward pass still runs.

Each differentiated leaf goes through an identity with a custom VJP (a
*tap*). Its backward rule runs as soon as that leaf's cotangent is complete:
it starts the leaf's push_pull (the start host callback) and hands the
callback's ticket back as the cotangent of a scalar *slot* input, so the
ticket leaves the backward pass as data. After the backward pass one done
callback per leaf waits for that leaf's sum. The leaf's own cotangent is
zero: its sum, not its local gradient, is the result.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from jaxps._src import jit_errors, naming, state
from jaxps.ops import _host
from jaxps.ops._push_pull import leaf_names


def _start(name, average, priority, mode, shard, grad):
    # a float32 holds every ticket exactly (they stay below _host.TICKETS)
    ticket = _host.start((name,), average, (priority,), mode, shard, grad)
    return np.float32(ticket)


def _done(ticket):
    return _host.done(int(ticket))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tap(leaf, slot, spec):
    del slot, spec
    return leaf


def _tap_fwd(leaf, slot, spec):
    del slot, spec
    return leaf, None


def _tap_bwd(spec, _, cotangent):
    name, average, priority, axis_name = spec
    shard, pushed = jnp.int32(0), cotangent
    if axis_name is not None:  # this device pushes its 1/L of the local sum
        shard = lax.axis_index(axis_name).astype(jnp.int32)
        pushed = lax.psum_scatter(
            _padded(cotangent, lax.axis_size(axis_name)), axis_name, tiled=True
        )
        # the runtime divides by the ranks that pushed; _collect by local
    ticket = io_callback(
        jit_errors.in_callback(
            functools.partial(_start, name, average, priority, "sync")
        ),
        jax.ShapeDtypeStruct((), jnp.float32),
        shard,
        pushed,
        ordered=False,
    )
    return jnp.zeros_like(cotangent), ticket


def _padded(leaf, local):
    flat = jnp.ravel(leaf)
    return jnp.pad(flat, (0, -flat.size % local))


_tap.defvjp(_tap_fwd, _tap_bwd)


def value_and_grad(
    fun,
    argnums: int = 0,
    has_aux: bool = False,
    *,
    average: bool = True,
    name: str | None = None,
    priorities=None,
    axis_name=None,
):
    """`jax.value_and_grad` whose gradients are summed over the workers.

    Each leaf's push_pull starts inside the backward pass, as soon as its
    gradient is complete, so communication overlaps the rest of the
    backward pass; the sums are waited for at the end. The result equals
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

    Not covered (use `DistributedOptimizer`): ``backward_passes_per_step``
    (local accumulation) and compression.

    Args:
      fun: the loss; returns a scalar (and an aux value if `has_aux`).
      argnums: the one positional argument to differentiate.
      has_aux: `fun` returns ``(loss, aux)``.
      average: average (rather than sum) the gradients over workers.
      name: push_pull name of the gradients. Default: the call site,
        numbered within the `jax.jit` trace (as `push_pull`'s).
      priorities: one int per leaf, higher goes out first. Default: leaves
        earlier in the tree first (the first layers, which the next
        forward pass needs first).
      axis_name: the shard_map / pmap axis of the local devices, or None.

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
            )
        leaves, treedef = jax.tree.flatten(target)
        specs = _specs(
            target, base, average, priorities, len(leaves), axis_name
        )
        slots = [jnp.zeros((), jnp.float32) for _ in leaves]

        def tapped(tree, slots, *rest):
            taps = [
                leaf if spec is None else _tap(leaf, slot, spec)
                for leaf, slot, spec in zip(jax.tree.leaves(tree), slots, specs)
            ]
            call = list(rest)
            call.insert(argnums % len(args), treedef.unflatten(taps))
            return fun(*call, **kwargs)

        rest = [a for i, a in enumerate(args) if i != argnums % len(args)]
        value, (grads, tickets) = jax.value_and_grad(
            tapped, argnums=(0, 1), has_aux=has_aux
        )(target, slots, *rest)
        return value, _collect(grads, tickets, specs, average, axis_name)

    return wrapped


def _specs(tree, base, average, priorities, count, axis_name):
    """Per leaf: (wire name, average, priority, axis_name), or None."""
    leaves = jax.tree.leaves(tree)
    if priorities is None:
        priorities = [-i for i in range(count)]
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
        specs.append(
            None if empty else (leaf_name, average, priority, axis_name)
        )
    return specs


def _collect(grads, tickets, specs, average, axis_name):
    """The summed gradients: one done per pushed leaf."""
    leaves, treedef = jax.tree.flatten(grads)
    outs = []
    for leaf, ticket, spec in zip(leaves, tickets, specs):
        if spec is None:
            outs.append(leaf)
            continue
        pushed = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        if axis_name is not None:
            local = lax.axis_size(axis_name)
            size = _padded(leaf, local).size // local
            pushed = jax.ShapeDtypeStruct((size,), leaf.dtype)
        (out,) = io_callback(
            jit_errors.in_callback(_done), (pushed,), ticket, ordered=False
        )
        if axis_name is not None:
            if average:
                out = out / jnp.asarray(local, out.dtype)
            out = lax.all_gather(out, axis_name, tiled=True)
            out = out[: leaf.size].reshape(leaf.shape)
        outs.append(out)
    return treedef.unflatten(outs)


def _module_value_and_grad(
    nnx, fun, argnums, has_aux, args, kwargs, base, average, axis_name
):
    """`value_and_grad` of an `nnx.Module` argument, by its `nnx.Param`s."""
    module = args[argnums]
    params = nnx.state(module, nnx.Param)
    leaves = jax.tree.leaves(params)
    specs = _specs(params, base, average, None, len(leaves), axis_name)
    slots = [jnp.zeros((), jnp.float32) for _ in leaves]

    def tapped(module, slots):
        inner = nnx.state(module, nnx.Param)
        flat, treedef = jax.tree.flatten(inner)
        taps = [
            leaf if spec is None else _tap(leaf, slot, spec)
            for leaf, slot, spec in zip(flat, slots, specs)
        ]
        nnx.update(module, treedef.unflatten(taps))
        call = list(args)
        call[argnums] = module
        return fun(*call, **kwargs)

    value, (grads, tickets) = nnx.value_and_grad(
        tapped, argnums=(0, 1), has_aux=has_aux
    )(module, slots)
    return value, _collect(grads, tickets, specs, average, axis_name)
