"""The ``jaxps_push_pull`` primitive and its rules.

Operands are the arrays to sum plus an int32 shard index (the device's index
on the local mesh axis, 0 outside of shard_map/pmap). It lowers to two XLA
host callbacks: a start that hands the arrays to the runtime and returns a
ticket at once, and a done that waits for the sums. push_pull is linear, so
its JVP and its transpose are push_pulls of the tangents and cotangents.

Other workers wait for every push, so a push_pull whose result is unused
must still run (no dead-code elimination), and it must run exactly once per
step: under `jax.checkpoint` / remat its outputs are saved as residuals
whatever the policy, so the backward pass reuses the sum instead of pushing
again under the same name. An effect would give both, but a jit with any
effect cannot take JAX's C++ dispatch path (about 0.03 ms more per input
and output array, `benchmarks/leaves.py`), so the primitive has none and
`_callback.keep_always` registers a dead-code and a remat rule instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxps._src import jit_errors
from jaxps.ops import _callback, _host, _sharded

push_pull_p = Primitive("jaxps_push_pull")
push_pull_p.multiple_results = True


def bind(arrays, shard, *, names, average, priorities, mode="sync"):
    """Binds the primitive; returns the summed (or averaged) arrays.

    `mode` (``"sync"`` or ``"async"``, see `jaxps._src.runtime.MODES`) is a
    static parameter: the runtime checks it against the servers' mode.
    """
    return push_pull_p.bind(
        *arrays,
        shard,
        names=tuple(names),
        average=bool(average),
        priorities=tuple(priorities),
        mode=str(mode),
    )


def _abstract_eval(*avals, names, average, priorities, mode):
    del average, priorities, mode
    *arrays, shard = avals
    if len(arrays) != len(names):
        raise ValueError(
            f"push_pull got {len(arrays)} arrays for {len(names)} names."
        )
    if shard.shape != () or shard.dtype != jnp.int32:
        raise TypeError(
            f"push_pull shard index must be an int32 scalar, got "
            f"{shard.dtype}{list(shard.shape)}."
        )
    # same shape, dtype and sharding; varying over the same manual axes as
    # each operand (for shard_map's check_vma)
    return [a.update(weak_type=False) for a in arrays], set()


def _impl(*args, names, average, priorities, mode):
    *arrays, shard = args
    ticket = _host.start(
        names,
        average,
        priorities,
        mode,
        np.asarray(shard),
        *[np.asarray(a) for a in arrays],
    )
    return [jnp.asarray(o) for o in _host.done(ticket)]


def _callbacks(*args, names, average, priorities, mode, platforms):
    *arrays, shard = args
    operands, layout = _host.fuse(arrays, platforms, names)
    ticket = _callback.call(
        jit_errors.in_callback(
            functools.partial(
                _host.start,
                names,
                average,
                priorities,
                mode,
                layout=layout,
                from_callback=True,
            )
        ),
        jax.ShapeDtypeStruct((), jnp.int32),
        shard,
        *operands,
    )
    results = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in operands)
    sums = _callback.call(jit_errors.in_callback(_host.done), results, ticket)
    return list(sums) if layout is None else layout.unfuse(sums)


def _suffixed(names, suffix):
    return tuple(f"{n}{suffix}" for n in names)


def _jvp(primals, tangents, *, names, average, priorities, mode):
    *arrays, shard = primals
    out = bind(
        arrays,
        shard,
        names=names,
        average=average,
        priorities=priorities,
        mode=mode,
    )
    tangents = [ad.instantiate_zeros(t) for t in tangents[:-1]]
    tangent_out = bind(
        tangents,
        shard,
        names=_suffixed(names, "/jvp"),
        average=average,
        priorities=priorities,
        mode=mode,
    )
    return out, tangent_out


def _transpose(cotangents, *args, names, average, priorities, mode):
    *arrays, shard = args
    if ad.is_undefined_primal(shard):
        raise ValueError("push_pull is not linear in its shard index.")
    cts = [
        ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
        for ct in cotangents
    ]
    outs = bind(
        cts,
        shard,
        names=_suffixed(names, "/T"),
        average=average,
        priorities=priorities,
        mode=mode,
    )
    return [*outs, None]


def _batch(args, dims, *, names, average, priorities, mode):
    *arrays, shard = args
    *array_dims, shard_dim = dims
    if shard_dim is not None:
        raise ValueError(
            "push_pull cannot vmap over its shard index; use "
            "shard_map or pmap with axis_name instead."
        )
    moved = [
        a if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(arrays, array_dims)
    ]
    names = tuple(
        n if d is None else f"{n}/vmap{a.shape[0]}"
        for n, a, d in zip(names, moved, array_dims)
    )
    outs = bind(
        moved,
        shard,
        names=names,
        average=average,
        priorities=priorities,
        mode=mode,
    )
    out_dims = [None if d is None else 0 for d in array_dims]
    return outs, out_dims


push_pull_p.def_impl(_impl)
push_pull_p.def_effectful_abstract_eval(_abstract_eval)
_callback.keep_always(push_pull_p)


def _lowering(ctx, *args, **params):
    mesh = _sharded.lowering_mesh(ctx)
    if mesh is None:
        lower = functools.partial(
            _callbacks, platforms=ctx.module_context.platforms
        )
    else:  # a jit over several devices, traced without a mesh

        def lower(*args, names, average, priorities, mode):
            return _sharded.push_pull(
                args[:-1], names, priorities, average, mode, mesh
            )

    return mlir.lower_fun(lower, multiple_results=True)(ctx, *args, **params)


mlir.register_lowering(push_pull_p, _lowering)
ad.primitive_jvps[push_pull_p] = _jvp
ad.primitive_transposes[push_pull_p] = _transpose
batching.primitive_batchers[push_pull_p] = _batch
