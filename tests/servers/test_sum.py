"""The optional native sum with streaming stores (servers/_sum.c)."""

import platform

import numpy as np
import pytest

from jaxps.servers import Store, _kernels, _wire

_sum = _kernels._sum
KINDS = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "i8": np.int64}
X86 = platform.machine() in ("x86_64", "AMD64")


def test_built_where_it_streams():
    # CI installs on x86-64 with a C compiler: the module must be there
    if not X86:
        pytest.skip("streaming stores are x86-64 only")
    assert _sum is not None and _sum.NONTEMPORAL == 1


needs_sum = pytest.mark.skipif(_sum is None, reason="_sum not built")


@needs_sum
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("n", [0, 1, 7, 33, 100_003])
def test_add_matches_numpy(kind, offset, n):
    # offsets make `out` unaligned, so the scalar head runs too
    dtype = KINDS[kind]
    rng = np.random.default_rng(n)
    a, b = (
        rng.integers(-1000, 1000, n + offset).astype(dtype) for _ in range(2)
    )
    out = np.full(n + offset, 7, dtype)
    _sum.add(kind, a[offset:], b[offset:], out[offset:])
    np.testing.assert_array_equal(out[offset:], a[offset:] + b[offset:])
    assert (out[:offset] == 7).all()  # nothing written before


@needs_sum
@pytest.mark.parametrize("kind", ["i4", "i8"])
def test_integers_wrap_around_like_numpy(kind):
    dtype = KINDS[kind]
    top = np.iinfo(dtype).max
    a = np.full(37, top, dtype)
    out = np.empty_like(a)
    _sum.add(kind, a, np.ones_like(a), out)
    np.testing.assert_array_equal(out, a + np.ones_like(a))  # wraps


@needs_sum
def test_add_rejects_bad_input():
    a = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="kind must be"):
        _sum.add("f2", a, a, np.empty_like(a))
    with pytest.raises(ValueError, match="one size"):
        _sum.add("f4", a, a[:4], np.empty_like(a))
    with pytest.raises(ValueError, match="multiple of 8"):
        _sum.add("f8", a[:3], a[:3], np.empty(3, np.float32))
    with pytest.raises(TypeError):
        _sum.add("f4", a, a, a.tobytes())  # read-only output


@pytest.mark.parametrize(
    "dtype", _wire.supported_dtypes(), ids=lambda d: np.dtype(d).name
)
def test_store_sum_of_payloads_is_exact(dtype):
    # payloads in messages: the accumulator gets a + b (streamed if built)
    store = Store(2)
    x = (np.arange(1001) % 50).astype(dtype)
    for rank in range(2):
        payload = (x * (rank + 1)).tobytes()
        ticket = store.begin_push(
            key=1,
            round=0,
            rank=rank,
            dtype_code=_wire.dtype_code(x.dtype),
            length=x.size,
            payload=payload,
            checksum=rank,
        )
        ticket.run()
    _, got = store.pull(
        key=1,
        round=0,
        rank=0,
        dtype_code=_wire.dtype_code(x.dtype),
        length=x.size,
        raw=True,
    )
    np.testing.assert_array_equal(
        got.astype(np.float64), 3 * x.astype(np.float64)
    )
