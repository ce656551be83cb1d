"""The server's add kernels: numpy, with streaming stores where built.

`add_into` writes ``a + b`` into an accumulator with the optional C
extension `_sum` (``servers/_sum.c``) for the dtypes of `STREAMED`;
`add_and_copy` adds in place and copies the sum out a cache-sized block at a
time; `accumulator_dtype` names the dtype sums are made in.
"""

from __future__ import annotations

import numpy as np

try:  # optional: built from _sum.c where a C compiler was found
    from . import _sum
except ImportError:
    _sum = None

#: Dtypes `_sum.add` sums with streaming stores, by its kind code.
STREAMED = {
    np.dtype(np.float32): "f4",
    np.dtype(np.float64): "f8",
    np.dtype(np.int32): "i4",
    np.dtype(np.int64): "i8",
}

# Half-precision payloads are accumulated in float32 and cast back once.
_ACCUMULATOR = {
    np.dtype(np.float16): np.dtype(np.float32),
}

#: Block of `add_and_copy`: the copies read it from the core's cache.
BLOCK_BYTES = 256 * 1024


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype sums of `dtype` are made in (float32 for half precision)."""
    if dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return _ACCUMULATOR.get(dtype, dtype)


def add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a + b`` into a third array (an accumulator, most likely not
    in the cache), with streaming stores where `_sum` is built: ordinary
    stores would first read every line of `out`."""
    kind = STREAMED.get(out.dtype)
    if (
        _sum is not None
        and _sum.NONTEMPORAL
        and kind is not None
        and a.dtype == b.dtype == out.dtype
    ):
        _sum.add(kind, a, b, out)
    else:
        np.add(a, b, out=out, dtype=out.dtype, casting="unsafe")


def add_and_copy(running: np.ndarray, data: np.ndarray, copies) -> None:
    """``running += data``, then `running` into each of `copies`, a block at
    a time, so the copies read the sum from the cache, not from memory."""
    step = max(1, BLOCK_BYTES // running.itemsize)
    for lo in range(0, running.size, step):
        block = running[lo : lo + step]
        np.add(block, data[lo : lo + step], out=block, casting="unsafe")
        for copy in copies:
            np.copyto(copy[lo : lo + step], block)


def cast(acc: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`acc` in `dtype`: itself if it has it, else a converted copy."""
    return acc if acc.dtype == dtype else acc.astype(dtype)
