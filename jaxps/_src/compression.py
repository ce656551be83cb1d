"""Wire compression of gradients, for `DistributedOptimizer(compression=...)`.

A `Compression` averages a gradient pytree over the workers through
push_pull while sending fewer bytes. Servers only sum, so every scheme is
built from sums:

- `fp16` / `bf16` cast the gradients for the wire (servers accumulate half
  precision in float32);
- `randomk` sends the same k random coordinates on every worker (a seed
  shared by all workers and the step), summed densely;
- `topk` and `onebit` send per-worker data (each worker's largest coordinates
  and their indices, or packed signs and a scale): each worker writes its own
  slot of a zeroed buffer with one slot per worker, so the servers' sum hands
  every worker all slots (a gather), and each worker decodes the average.

The sparse and 1-bit schemes keep what they did not send in an error-feedback
residual on the worker and add it to the next step's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxps._src import state as _state
from jaxps._src.topology import tensor_id
from jaxps.ops import push_pull


class Compression(NamedTuple):
    """A gradient-averaging scheme.

    Attributes:
      init: ``params -> state`` (e.g. error-feedback residuals).
      reduce: ``(grads, state, name) -> (mean grads, state)``.
      wire_bytes: ``(num_elements, itemsize, num_workers) -> bytes`` one
        worker pushes for one tensor, for reports.
    """

    init: Callable[[Any], Any]
    reduce: Callable[[Any, Any, str], tuple[Any, Any]]
    wire_bytes: Callable[[int, int, int], int]


class ResidualState(NamedTuple):
    """Error-feedback residuals (one per leaf) and the step counter."""

    residual: Any
    step: jax.Array


def none() -> Compression:
    """No compression: push_pull the gradients as they are."""
    return Compression(
        init=lambda params: (),
        reduce=lambda g, s, name: (push_pull(g, name=name), s),
        wire_bytes=lambda n, itemsize, workers: n * itemsize,
    )


def _cast(dtype) -> Compression:
    def reduce(grads, state, name):
        wire = jax.tree.map(lambda g: g.astype(dtype), grads)
        mean = push_pull(wire, name=name)
        return jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grads), state

    return Compression(
        init=lambda params: (),
        reduce=reduce,
        wire_bytes=lambda n, itemsize, workers: n * jnp.dtype(dtype).itemsize,
    )


def fp16() -> Compression:
    """Send float16 (half the bytes of float32)."""
    return _cast(jnp.float16)


def bf16() -> Compression:
    """Send bfloat16 (half the bytes of float32, float32's range)."""
    return _cast(jnp.bfloat16)


def _keep(ratio: float, n: int) -> int:
    return max(1, min(n, int(round(ratio * n))))


def _residual_init(params) -> ResidualState:
    residual = jax.tree.map(
        lambda p: jnp.zeros(jnp.size(p), jnp.float32), params
    )
    return ResidualState(residual, jnp.int32(0))


def _per_leaf(pack, unpack, average: bool) -> Callable:
    """Builds `reduce` from a per-leaf pack / unpack pair.

    ``pack(flat, leaf_name, step) -> (wire, aux)`` turns a leaf (gradient plus
    residual, float32, flat) into arrays to push; all leaves' arrays go out in
    one push_pull. ``unpack(summed_wire, aux, flat) -> (mean, sent)`` decodes
    the sums; `sent` is what this worker's message stood for, so the new
    residual is ``flat - sent``.
    """

    def reduce(grads, state, name):
        leaves, treedef = jax.tree.flatten(grads)
        residuals = treedef.flatten_up_to(state.residual)
        flats, wires, auxes = [], [], []
        for i, (g, r) in enumerate(zip(leaves, residuals)):
            flat = jnp.ravel(g).astype(jnp.float32) + r
            wire, aux = pack(flat, f"{name}/{i}", state.step)
            flats.append(flat)
            wires.append(wire)
            auxes.append(aux)
        summed = push_pull(wires, average=average, name=name)
        means, new_residuals = [], []
        for g, flat, wire, aux in zip(leaves, flats, summed, auxes):
            mean, sent = unpack(wire, aux, flat)
            means.append(mean.reshape(jnp.shape(g)).astype(g.dtype))
            new_residuals.append(flat - sent)
        out = jax.tree.unflatten(treedef, means)
        residual = jax.tree.unflatten(treedef, new_residuals)
        return out, ResidualState(residual, state.step + 1)

    return reduce


def _slot(value):
    """A zeroed buffer with one slot per worker, this worker's filled in.

    Summed over workers it holds every worker's `value`: a gather.
    """
    n, rank = _state.size(), _state.rank()
    slots = jnp.zeros((n, *value.shape), value.dtype)
    return slots.at[rank].set(value)


def topk(ratio: float = 0.01, error_feedback: bool = True) -> Compression:
    """Send each worker's `ratio` largest-magnitude coordinates.

    Args:
      ratio: fraction of coordinates kept per tensor (at least one).
      error_feedback: carry what was not sent into the next step.
    """

    def pack(flat, name, step):
        del name, step
        _, idx = lax.top_k(jnp.abs(flat), _keep(ratio, flat.size))
        vals = flat[idx]
        return {"values": _slot(vals), "indices": _slot(idx)}, (idx, vals)

    def unpack(wire, aux, flat):
        idx, vals = aux
        dense = (
            jnp.zeros_like(flat)
            .at[wire["indices"].ravel()]
            .add(wire["values"].ravel())
        )
        sent = jnp.zeros_like(flat).at[idx].set(vals)
        return dense / _state.size(), sent if error_feedback else flat

    return Compression(
        init=_residual_init,
        reduce=_per_leaf(pack, unpack, average=False),
        wire_bytes=lambda n, itemsize, workers: workers * _keep(ratio, n) * 8,
    )


def randomk(
    ratio: float = 0.01, seed: int = 0, error_feedback: bool = True
) -> Compression:
    """Send the same `ratio` random coordinates on every worker.

    The coordinates depend on `seed`, the tensor and the step only, so all
    workers pick the same ones and their values are summed densely.
    """

    def pack(flat, name, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        key = jax.random.fold_in(key, tensor_id(name) & 0x7FFFFFFF)
        k = _keep(ratio, flat.size)
        idx = jax.random.choice(key, flat.size, (k,), replace=False)
        return flat[idx], idx

    def unpack(mean_vals, idx, flat):
        dense = jnp.zeros_like(flat).at[idx].set(mean_vals)
        sent = jnp.zeros_like(flat).at[idx].set(flat[idx])
        return dense, sent if error_feedback else flat

    return Compression(
        init=_residual_init,
        reduce=_per_leaf(pack, unpack, average=True),
        wire_bytes=lambda n, itemsize, workers: _keep(ratio, n) * 4,
    )


def _pack_signs(positive):
    pad = -positive.size % 32
    bits = jnp.pad(positive, (0, pad)).reshape(-1, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=1)
    return lax.bitcast_convert_type(words, jnp.int32)


def _unpack_signs(words, size):
    words = lax.bitcast_convert_type(words, jnp.uint32)
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :size]


def onebit(error_feedback: bool = True) -> Compression:
    """Send one bit per coordinate (its sign) and one scale per tensor.

    Each worker's message stands for ``scale * sign(x)`` with ``scale`` the
    mean absolute value; the result is the average of those over workers.
    """

    def pack(flat, name, step):
        del name, step
        scale = jnp.mean(jnp.abs(flat))
        positive = flat >= 0
        wire = {"signs": _slot(_pack_signs(positive)), "scale": _slot(scale)}
        return wire, (scale, positive)

    def unpack(wire, aux, flat):
        scale, positive = aux
        signs = _unpack_signs(wire["signs"], flat.size).astype(jnp.float32)
        scales = wire["scale"][:, None]
        dense = jnp.mean(scales * (2 * signs - 1), axis=0)
        sent = scale * jnp.where(positive, 1.0, -1.0)
        return dense, sent if error_feedback else flat

    return Compression(
        init=_residual_init,
        reduce=_per_leaf(pack, unpack, average=False),
        wire_bytes=lambda n, itemsize, workers: workers * (4 * -(-n // 32) + 4),
    )
