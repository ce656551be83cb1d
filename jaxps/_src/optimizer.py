"""Optax transformations that push_pull: `sync_gradients`, the optimizers."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxps._src import naming
from jaxps._src.compression import Compression
from jaxps.ops import push_pull


class SyncGradientsState(NamedTuple):
    """State of `sync_gradients`."""

    grad_acc: optax.Updates  # local sum of the mini-steps' gradients
    mini_step: jax.Array  # int32: mini-steps since the last communication
    compression_state: Any = ()  # e.g. error-feedback residuals


def _check_passes(k):
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1. Got "
            f"backward_passes_per_step={k!r}."
        )
    return k


def _every_kth(k, updates, acc, mini_step, run, carry):
    """Sums `updates` into `acc`; every k-th call runs `run(acc / k, carry)`.

    `run` gets the mean of the k mini-steps' updates, not their sum.

    One `lax.cond` gates `run` (and so the push_pull in it). Returns
    ``(out, carry, acc, mini_step)``; between runs `out` is zeros and `carry`
    is unchanged.
    """
    acc = jax.tree.map(jnp.add, acc, updates)
    step = mini_step + 1

    def communicate(acc):
        out, new_carry = run(jax.tree.map(lambda g: g / k, acc), carry)
        return out, new_carry, jax.tree.map(jnp.zeros_like, acc)

    def accumulate(acc):
        return jax.tree.map(jnp.zeros_like, updates), carry, acc

    out, carry, acc = lax.cond(step % k == 0, communicate, accumulate, acc)
    return out, carry, acc, step % k


def sync_gradients(
    *,
    average: bool = True,
    backward_passes_per_step: int = 1,
    axis_name=None,
    name: str | None = None,
    compression: Compression | None = None,
    mesh=None,
) -> optax.GradientTransformation:
    """Replaces the gradients by their mean (or sum) over all workers.

    A chainable transformation: each `update` push_pulls the gradients to
    the summation servers. With ``backward_passes_per_step=k`` the
    gradients of k updates are averaged locally (their sum divided by k, as
    `optax.MultiSteps` does by default) and that mean is communicated once,
    on every k-th update; the updates in between are zeros. With
    ``average=True`` the result is the mean over all k passes of all
    workers: for a loss that is a mean over the batch, k mini-batches of b
    examples step like one batch of k*b.
    (Horovod's default sums the k passes instead; multiply the learning
    rate by k for the same steps.) An optimizer chained after it still
    steps on those zeros (a stateful one changes its state);
    `DistributedOptimizer(inner, backward_passes_per_step=k)` skips `inner`
    instead.

    Args:
      average: average (rather than sum) the gradients over workers.
      backward_passes_per_step: local accumulation steps per communication;
        their gradients are averaged.
      axis_name: the shard_map / pmap axis of the local devices, if any.
      name: push_pull name of the gradients. Default: derived from where
        `update` is called, unique within a jitted step.
      compression: a `jaxps.compression` scheme for the wire (it averages).
      mesh: the host mesh of a sharded `jax.jit` (see `jaxps.push_pull`);
        by default found from the gradients or the context.

    Returns:
      An `optax.GradientTransformation`.

    >>> import jax.numpy as jnp, optax, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> opt = optax.chain(jaxps.sync_gradients(), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.ones(2)}, state, params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    >>> jaxps.shutdown()
    """
    k = _check_passes(backward_passes_per_step)
    if compression is not None and (axis_name is not None or not average):
        raise ValueError(
            "compression averages over workers on one device per worker: it "
            "cannot be combined with axis_name or average=False."
        )

    def sync(grads, comp_state):
        wire_name = name or naming.default_name("grads")
        if compression is not None:
            return compression.reduce(grads, comp_state, wire_name)
        mean = push_pull(
            grads,
            average=average,
            name=wire_name,
            axis_name=axis_name,
            mesh=mesh,
        )
        return mean, comp_state

    def init_fn(params):
        acc = jax.tree.map(jnp.zeros_like, params) if k > 1 else ()
        comp = compression.init(params) if compression is not None else ()
        return SyncGradientsState(acc, jnp.int32(0), comp)

    def update_fn(updates, state, params=None):
        del params
        if k == 1:
            mean, comp = sync(updates, state.compression_state)
            return mean, state._replace(compression_state=comp)
        comp = state.compression_state
        mean, comp, acc, step = _every_kth(
            k, updates, state.grad_acc, state.mini_step, sync, comp
        )
        return mean, SyncGradientsState(acc, step, comp)

    return optax.GradientTransformation(init_fn, update_fn)


class DistributedState(NamedTuple):
    """State of `DistributedOptimizer`: `inner`'s, then `sync_gradients`'."""

    inner_state: optax.OptState
    grad_acc: optax.Updates  # local sum of the mini-steps' gradients
    mini_step: jax.Array  # int32: mini-steps since the last communication
    compression_state: Any = ()  # e.g. error-feedback residuals


def DistributedOptimizer(  # noqa: N802 - the name users know from BytePS
    inner: optax.GradientTransformation,
    *,
    average: bool = True,
    backward_passes_per_step: int = 1,
    axis_name=None,
    name: str | None = None,
    compression: Compression | None = None,
    mesh=None,
) -> optax.GradientTransformation:
    """Wraps an optax optimizer so that it sees the workers' mean gradient.

    ``optax.chain(sync_gradients(...), inner)``: each `update` push_pulls
    the gradients to the summation servers and hands the result to `inner`;
    servers only sum, the optimizer runs here. With
    ``backward_passes_per_step=k`` the gradients of k updates are averaged
    locally (their sum divided by k, as `optax.MultiSteps` does by default)
    and that chain runs once, on every k-th update, on those local means
    averaged (or, with ``average=False``, summed) over the workers; the
    updates in between are zero and leave `inner`'s state untouched. For
    a loss that is a mean over the batch, k mini-batches of b examples
    then step like one batch of k*b, with the same learning rate.
    (Horovod's default sums the k passes instead; multiply the learning
    rate by k for the same steps.)

    Args:
      inner: the optimizer to run on the synchronized gradients.
      average: average (rather than sum) the gradients over workers.
      backward_passes_per_step: local accumulation steps per communication;
        their gradients are averaged.
      axis_name: the shard_map / pmap axis of the local devices, if any.
      name: push_pull name of the gradients. Default: derived from where
        `update` is called, unique within a jitted step (two optimizers
        in one step do not collide).
      compression: a `jaxps.compression` scheme for the wire (it averages).
      mesh: the host mesh of a sharded `jax.jit` (see `jaxps.push_pull`);
        by default found from the gradients or the context.

    Returns:
      An `optax.GradientTransformation`.

    >>> import jax.numpy as jnp, optax, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> opt = jaxps.DistributedOptimizer(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.ones(2)}, state, params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    >>> jaxps.shutdown()
    """
    k = _check_passes(backward_passes_per_step)
    tx = optax.chain(
        sync_gradients(
            average=average,
            axis_name=axis_name,
            name=name,
            compression=compression,
            mesh=mesh,
        ),
        inner,
    )

    def init_fn(params):
        sync_state, inner_state = tx.init(params)
        acc = jax.tree.map(jnp.zeros_like, params) if k > 1 else ()
        comp = sync_state.compression_state
        return DistributedState(inner_state, acc, sync_state.mini_step, comp)

    def update_fn(updates, state, params=None):
        def run(grads, carry):  # tx on this state's parts
            inner_state, comp = carry
            sync_state = SyncGradientsState((), state.mini_step, comp)
            out, (sync_state, inner_state) = tx.update(
                grads, (sync_state, inner_state), params
            )
            return out, (inner_state, sync_state.compression_state)

        carry = (state.inner_state, state.compression_state)
        if k == 1:
            out, (inner_state, comp) = run(updates, carry)
            return out, state._replace(
                inner_state=inner_state, compression_state=comp
            )
        out, (inner_state, comp), acc, step = _every_kth(
            k, updates, state.grad_acc, state.mini_step, run, carry
        )
        return out, DistributedState(inner_state, acc, step, comp)

    return optax.GradientTransformation(init_fn, update_fn)


class AsyncState(NamedTuple):
    """State of `AsyncDistributedOptimizer`."""

    inner_state: optax.OptState


def AsyncDistributedOptimizer(  # noqa: N802 - mirrors DistributedOptimizer
    inner: optax.GradientTransformation,
    *,
    name: str = "async_params",
) -> optax.GradientTransformation:
    """Asynchronous training against servers started with ``--async``.

    The servers hold the parameters (BytePS async mode). `init` pushes the
    initial parameters (the first worker's win). Each `update` runs `inner`
    locally, pushes the resulting delta, which the servers add at once, and
    pulls the latest parameters; there is no barrier between workers. The
    returned updates move `params` to those latest parameters.

    Args:
      inner: the local optimizer.
      name: push_pull name of the parameters.

    Returns:
      An `optax.GradientTransformation`.
    """

    def init_fn(params):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            raise ValueError(
                "AsyncDistributedOptimizer.init pushes the initial parameters "
                "to the servers: call it outside of jit."
            )
        # round 0: the initial value
        push_pull(params, average=False, name=name, mode="async")
        return AsyncState(inner.init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "AsyncDistributedOptimizer.update needs params: call "
                "update(grads, state, params)."
            )
        delta, inner_state = inner.update(updates, state.inner_state, params)
        latest = push_pull(delta, average=False, name=name, mode="async")
        moved = jax.tree.map(lambda new, old: new - old, latest, params)
        return moved, AsyncState(inner_state)

    return optax.GradientTransformation(init_fn, update_fn)
