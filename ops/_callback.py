"""`call`: a host callback that hands XLA's own host buffers to Python.

jaxps's ops talk to the runtime through host callbacks. `io_callback` is not
used for them: before calling its function it ``device_put``s every operand
onto CPU device 0, and reading that array waits for a transfer that the CPU
client runs on its thread pool (sized from the CPU affinity mask, 2 on a
2-core host). Under a multi-device program the other devices hold those
threads in a collective's rendezvous (``psum_scatter`` / ``all_gather``), so
the transfer never runs: from about 1 MiB of operand per device the program
deadlocks, whatever the callback does. Measured on 4 forced CPU devices: a
callback that returns ``2 * x`` of a 1024x1024 ``psum_scatter`` hangs through
``io_callback`` and takes 0.3 s (its own sleep) through `call`.

`call` lowers with JAX's own ``emit_python_callback`` and passes the
callback the NumPy arrays XLA hands over (host copies the arrays own, on
CPU in jaxlib 0.10 as on GPU; see `_host._kept`): no transfer, no thread
pool, one copy fewer. Like jaxps's push_pull primitive it is never dropped
and never run again by remat (`keep_always`), and inside a fully manual
``shard_map`` or ``pmap`` it runs once per device.
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import callback as _jax_callback
from jax._src import core as _core
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import Primitive
from jax.interpreters import mlir


def keep_always(primitive: Primitive) -> None:
    """What an effect would give `primitive`, without one: it is never
    dead-code eliminated (other workers wait for it), and under
    `jax.checkpoint` it is never run again in the backward pass (its
    outputs are saved). Without an effect in the program, a jit takes
    JAX's C++ dispatch path: a jitted function with any effect runs the
    Python one, about 0.03 ms per input and output array."""
    _pe.dce_rules[primitive] = lambda used, eqn: ([True] * len(eqn.invars), eqn)

    def saved(saveable, unknown, instantiated, eqn):
        del saveable
        n = len(eqn.outvars)
        if any(unknown):  # staged whole, its known inputs as residuals
            res = [
                v
                for v, inst in zip(eqn.invars, instantiated)
                if not inst and isinstance(v, _core.Var)
            ]
            return None, eqn, [True] * n, [True] * n, res
        return eqn, None, [False] * n, [False] * n, []

    _pe.partial_eval_jaxpr_custom_rules[primitive] = saved


_call_p = Primitive("jaxps_host_callback")
_call_p.multiple_results = True


def call(fn, result_shape_dtypes, *operands, per_device=None):
    """Calls ``fn(*numpy_operands)`` on the host from a JAX program.

    Args:
      fn: takes one NumPy array per operand (keep one past the call only
        if it owns its memory, as `_host._kept` checks) and returns one
        array per result.
      result_shape_dtypes: a `jax.ShapeDtypeStruct` or a tuple of them.
      *operands: arrays.
      per_device: None, or the name of the push_pull this callback serves:
        it must then run on each device with that device's data, and lowering
        it into a jit that XLA shards over several devices (where it would
        run on device 0 alone) fails, naming it.

    Returns:
      The result array, or a tuple of them if `result_shape_dtypes` is one.
    """
    single = isinstance(result_shape_dtypes, jax.ShapeDtypeStruct)
    results = (result_shape_dtypes,) if single else tuple(result_shape_dtypes)
    avals = tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in results)
    if single:
        fn = _returning_one(fn)
    outs = _call_p.bind(
        *operands, fn=fn, result_avals=avals, per_device=per_device
    )
    return outs[0] if single else tuple(outs)


def _returning_one(fn):
    return lambda *args: (fn(*args),)


def _impl(*operands, fn, result_avals, per_device):
    del per_device
    outs = fn(*(np.asarray(x) for x in operands))
    return [jax.numpy.asarray(o, a.dtype) for o, a in zip(outs, result_avals)]


def _abstract_eval(*avals, fn, result_avals, per_device):
    del avals, fn, per_device
    return list(result_avals), set()


def _lowering(ctx, *operands, fn, result_avals, per_device):
    del result_avals
    context = ctx.module_context.axis_context
    devices = getattr(context, "num_devices", 1)
    if per_device is not None and devices > 1:
        raise ValueError(
            f"{per_device!r} is in a jit over {devices} devices that jaxps "
            "cannot see when it traces (an Auto-axis mesh that is not in "
            "context). Run the step inside `with jax.set_mesh(mesh):`, pass "
            "mesh=mesh, or make the mesh with explicit axes (jax.make_mesh's "
            "default)."
        )
    sharding = _jax_callback._callback_op_sharding(
        ctx.module_context.axis_context, None, ctx.avals_out
    )
    results, _, _ = _jax_callback.emit_python_callback(
        ctx,
        fn,
        None,
        list(operands),
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=True,
        returns_token=False,
        sharding=sharding,
    )
    return results


def _batch(args, dims, **params):
    raise NotImplementedError(
        "a jaxps host callback cannot be vmapped: vmap push_pull itself "
        "(its batching rule pushes the batch as one tensor)."
    )


_call_p.def_impl(_impl)
_call_p.def_effectful_abstract_eval(_abstract_eval)
keep_always(_call_p)
mlir.register_lowering(_call_p, _lowering, cacheable=False)
jax.interpreters.batching.primitive_batchers[_call_p] = _batch
