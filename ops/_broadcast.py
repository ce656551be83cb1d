"""`broadcast`: one worker's values of a pytree on every worker, bit for bit.

The servers only sum, so `broadcast` sends bits, not values: every leaf is
bitcast to int32 words (its last word padded with zero bytes), the words of
all leaves go in one int32 vector, the root pushes its words and the others
zeros, and the int32 sum of one vector and zeros is that vector. Ahead of the
words go `size()` int32 slots in which rank r puts its ``root + 1``: after
the sum every worker knows every worker's root and refuses a mismatch.
"""

from __future__ import annotations

import functools
import operator
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxps._src import errors, jit_errors, naming, state
from jaxps.ops import _callback
from jaxps.ops._push_pull import push_pull


class _Spec(tp.NamedTuple):
    """What a broadcast call knows before it sees any values."""

    name: str
    root: int
    rank: int
    size: int


class _Leaf(tp.NamedTuple):
    """How a leaf travels: as `carrier`'s bytes (`_carrier` builds it)."""

    dtype: tp.Any
    carrier: jax.ShapeDtypeStruct
    impl: tp.Any  # the PRNG implementation of a key leaf, else None


def broadcast(tree, root: int = 0, *, name: str | None = None):
    """Returns `root`'s value of `tree` on every worker, bit for bit.

    Use it at start-up on the parameters and optimizer state (for instance
    ``nnx.state(model)``, PRNG keys included) so every worker starts
    identical. Every dtype arrives bit for bit (-0.0 and NaN payloads too),
    typed PRNG keys included, in one int32 push_pull. Empty leaves are
    returned as they are and a tree of only empty leaves makes no server
    call at all. Every worker must pass the same `root`; otherwise every
    worker raises `jaxps.errors.JaxpsError` naming each rank's root instead
    of returning a mix (under `jax.jit` the error comes when the program
    runs, as the `jax.errors.JaxRuntimeError` of the failed computation;
    `jaxps.errors.typed` gives it back as `JaxpsError`).

    Under `jax.grad` broadcast is the linear map "every worker gets root's
    input": the gradient w.r.t. root's floating leaves is the sum of all
    workers' cotangents (one more push_pull), and zero on the other workers
    and for integer, bool and key leaves (as in Horovod). Forward-mode
    (`jax.jvp`) is not supported.

    Args:
      tree: a pytree of arrays, with the same structure, shapes and dtypes on
        every worker.
      root: the rank whose values win, the same on every worker.
      name: a name unique among the push_pulls that may be in flight at
        once, the same on every worker. Default: the call site, numbered
        within the `jax.jit` trace (as `push_pull`'s).

    Returns:
      A pytree like `tree` with `root`'s values.

    Raises:
      ValueError: `root` is not a rank.
      JaxpsError: the workers passed different roots.

    >>> import jax.numpy as jnp, jaxps
    >>> _ = jaxps.init(num_workers=1)
    >>> jaxps.broadcast({"w": jnp.array([-0.0, 1.0])})
    {'w': Array([-0.,  1.], dtype=float32)}
    >>> jaxps.shutdown()
    """
    size = state.size()
    try:
        root = operator.index(root)
    except TypeError:
        raise TypeError(
            f"broadcast root must be a Python int, got root={root!r} of type "
            f"{type(root).__name__}."
        ) from None
    if not 0 <= root < size:
        raise ValueError(
            f"broadcast root must be in [0, {size}), got root={root}."
        )
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if _is_key(x) else jnp.asarray(x) for x in leaves]
    sent = [i for i, x in enumerate(leaves) if x.size]
    if sent:
        if name is None:
            name = naming.default_name("broadcast")
        spec = _Spec(name, root, state.rank(), size)
        outs = _exchange(spec, [leaves[i] for i in sent])
        for i, out in zip(sent, outs):
            leaves[i] = out
    return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchange(spec: _Spec, leaves):
    layout = [_layout(x) for x in leaves]
    roots = np.zeros(spec.size, np.int32)
    roots[spec.rank] = spec.root + 1
    if spec.rank == spec.root:
        data = [_to_words(_carrier(x)) for x in leaves]
    else:
        words = sum(_nwords(leaf.carrier) for leaf in layout)
        data = [jnp.zeros(words, jnp.int32)]
    # The leaves' dtypes and shapes name the words: ranks that pass
    # different ones fail the call check (MismatchError naming both)
    # instead of reading root's bits as their own dtype. (No brackets: the
    # key is a path of the call, see `plan.call_name`.)
    described = "leaves " + ", ".join(
        f"{leaf.dtype}{tuple(leaf.shape)}" for leaf in leaves
    )
    summed = push_pull(
        {"roots": jnp.asarray(roots), described: jnp.concatenate(data)},
        average=False,
        name=spec.name,
    )
    roots, words = summed["roots"], summed[described]
    if isinstance(roots, jax.core.Tracer):
        # Under jit: checked when the program runs; the words wait for it.
        words = words + _callback.call(
            jit_errors.in_callback(functools.partial(_check_roots, spec.name)),
            jax.ShapeDtypeStruct((), jnp.int32),
            roots,
        )
    else:
        _check_roots(spec.name, roots)
    outs, offset = [], 0
    for leaf in layout:
        size = _nwords(leaf.carrier)
        outs.append(_from_carrier(leaf, words[offset : offset + size]))
        offset += size
    return outs


def _fwd(spec, leaves):
    return _exchange(spec, leaves), None


def _bwd(spec, _, cotangents):
    floats = [
        i
        for i, ct in enumerate(cotangents)
        if jnp.issubdtype(ct.dtype, jnp.inexact)
    ]
    out = [None] * len(cotangents)  # None: a zero cotangent
    if floats:
        sums = push_pull(
            [cotangents[i] for i in floats],
            average=False,
            name=f"{spec.name}/grad",
        )
        # A select, not a Python branch: under jit JAX drops a push_pull
        # whose result is unused, and the other ranks would wait for it.
        keep = np.bool_(spec.rank == spec.root)
        for i, total in zip(floats, sums):
            out[i] = jnp.where(keep, total, jnp.zeros_like(total))
    return (out,)


_exchange.defvjp(_fwd, _bwd)


def _check_roots(name: str, roots) -> np.ndarray:
    """Raises unless every rank's slot holds the same ``root + 1``."""
    roots = np.asarray(roots)
    if len(set(roots.tolist())) > 1 or not 1 <= roots[0] <= roots.size:
        ranks = ", ".join(
            f"rank {r} root={int(v) - 1}" for r, v in enumerate(roots)
        )
        raise errors.JaxpsError(
            f"broadcast {name!r}: ranks passed different roots: {ranks}. "
            "Pass the same root on every worker."
        )
    return np.int32(0)


def _is_key(x) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _narrow(dtype) -> bool:
    """Sub-byte dtypes (int4, float4_e2m1fn, ...), which bitcast can't split."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits < 8
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits < 8
    return False


def _carrier(x):
    """`x` as an array whose bytes `lax.bitcast_convert_type` can take."""
    if _is_key(x):
        return jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([lax.real(x), lax.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if not _narrow(x.dtype):
        return x
    # every value of a sub-byte dtype is exact in a wider one of its kind
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        return x.astype(jnp.int8)
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return x.astype(jnp.uint8)
    return x.astype(jnp.float32)


def _layout(x) -> _Leaf:
    impl = jax.random.key_impl(x) if _is_key(x) else None
    return _Leaf(x.dtype, jax.eval_shape(_carrier, x), impl)


def _nwords(carrier: jax.ShapeDtypeStruct) -> int:
    nbytes = int(np.prod(carrier.shape)) * jnp.dtype(carrier.dtype).itemsize
    return -(-nbytes // 4)


def _to_words(carrier):
    """The bits of `carrier` as int32 words, its last one padded with 0."""
    itemsize = carrier.dtype.itemsize
    if itemsize >= 4:
        return lax.bitcast_convert_type(carrier, jnp.int32).reshape(-1)
    raw = lax.bitcast_convert_type(carrier, jnp.uint8).reshape(-1)
    raw = jnp.pad(raw, (0, -raw.size % 4))
    return lax.bitcast_convert_type(raw.reshape(-1, 4), jnp.int32)


def _from_carrier(leaf: _Leaf, words):
    """The leaf whose carrier's bits are `words` (from `_to_words`)."""
    shape, dtype = leaf.carrier.shape, jnp.dtype(leaf.carrier.dtype)
    if dtype.itemsize >= 4:
        chunk = words.reshape(*shape, dtype.itemsize // 4)
    else:
        raw = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
        chunk = raw[: int(np.prod(shape)) * dtype.itemsize]
        chunk = chunk.reshape(*shape, dtype.itemsize)
    if chunk.shape[-1] == 1:  # bitcast wants no trailing axis of one
        chunk = chunk.reshape(shape)
    value = lax.bitcast_convert_type(chunk, dtype)
    if leaf.impl is not None:
        return jax.random.wrap_key_data(value, impl=leaf.impl)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return lax.complex(value[..., 0], value[..., 1])
    return value.astype(leaf.dtype)  # back from bool and sub-byte carriers
