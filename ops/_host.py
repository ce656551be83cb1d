"""Host side of the push_pull op: what the XLA host callbacks run.

`start` hands the device's arrays to the worker runtime and returns a ticket
at once, so the device program goes on while the chunks travel; `done` waits
for the ticket's sums. A ticket is a small integer that flows from the start
callback to the done callback as data, which orders the two in XLA.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from jaxps._src import errors, state, timeline

_lock = threading.Lock()
_tickets: dict[int, object] = {}
#: the runtime the tickets are of; a new init drops the old one's
_owner = None
_next = itertools.count(1)
# Tickets stay below 2**24, so that a float32 holds one exactly (the
# overlapped backward pass carries them as cotangents, see _overlap.py).
TICKETS = 1 << 24


#: Fuse on the CPU too (tests of the fused operands on a machine without
#: an accelerator; there it costs a device-side copy and saves none).
FUSE_ON_CPU = False

#: Host copies `start` made (a test and the benchmarks read it).
host_copies = 0


def _kept(array: np.ndarray, from_callback: bool) -> np.ndarray:
    """`array`, or a copy of it where the caller may still reuse its memory.

    JAX's host callbacks hand over operands that are already host copies
    the arrays own: on CPU (jaxlib 0.10) a new NumPy array (``OWNDATA``),
    on GPU host memory held by a capsule that frees it with the array.
    Those are kept as they are, which saves a copy of every pushed byte.
    Anything else (a view of XLA's buffer, an eager caller's array) is
    copied: the runtime keeps what it is given until the servers answer.
    """
    global host_copies
    if from_callback and (
        array.flags.owndata or type(array.base).__name__ == "PyCapsule"
    ):
        return array
    with _lock:
        host_copies += 1
    return np.array(array, copy=True)


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """Where each leaf lies in the fused operands of its dtype.

    Attributes:
      groups: per fused operand, the indices of its leaves, in order.
      shapes: per leaf, its shape.
    """

    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]

    def split(self, fused) -> list[np.ndarray]:
        """The leaves, as views of the fused operands."""
        leaves = [None] * len(self.shapes)
        for group, buffer in zip(self.groups, fused):
            offset = 0
            for i in group:
                size = int(np.prod(self.shapes[i], dtype=np.int64))
                piece = buffer[offset : offset + size]
                leaves[i] = piece.reshape(self.shapes[i])
                offset += size
        return leaves


def fuse(arrays, platforms):
    """The callback operands of `arrays` (traced), and their layout.

    Off the CPU (`platforms` of the program) the arrays of each dtype are
    concatenated on the device, one flat operand per dtype, first seen
    first: JAX's GPU callback makes one device-to-host copy per operand,
    so a bucket of many leaves crosses in a few copies. Returns those
    operands and the `FusedLayout` that `start` splits them with; on the
    CPU (unless `FUSE_ON_CPU`), `arrays` and None.
    """
    if not FUSE_ON_CPU and tuple(platforms) == ("cpu",):
        return list(arrays), None
    import jax.numpy as jnp  # the host side needs numpy only

    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.dtype(a.dtype), []).append(i)
    layout = FusedLayout(
        tuple(tuple(g) for g in groups.values()),
        tuple(tuple(a.shape) for a in arrays),
    )
    operands = [
        jnp.concatenate([jnp.ravel(arrays[i]) for i in group])
        for group in layout.groups
    ]
    return operands, layout


def shard_names(names: tuple[str, ...], shard: int) -> list[str]:
    """Per-device tensor names: each device pushes its own shard."""
    return [f"{n}@{shard}" for n in names]


def start(
    names,
    average,
    priorities,
    mode,
    shard,
    *arrays,
    call=None,
    layout: FusedLayout | None = None,
    from_callback: bool = False,
) -> np.ndarray:
    """Starts push_pull of `arrays`; returns a ticket for `done`.

    `mode` is the push_pull's (``"sync"`` or ``"async"``); the runtime
    checks it against the servers it is connected to now. `call` names the
    call's check (default: from `names`, see `plan.call_name`), before the
    device's shard suffix. With a `layout`, `arrays` are the fused operands
    of each dtype (see `fuse`); `from_callback` says they are a host
    callback's operands (see `_kept`).
    """
    began = timeline.now()
    runtime = state.runtime()
    copies = [_kept(a, from_callback) for a in arrays]
    if layout is not None:
        copies = layout.split(copies)
    handle = runtime.push_pull_async(
        shard_names(names, int(shard)),
        copies,
        average=average,
        priorities=priorities,
        mode=mode,
        call=None if call is None else f"{call}@{int(shard)}",
        donate=True,  # its own copies
    )
    global _owner
    with _lock:
        if _owner is not runtime:
            # A new init: tickets whose done never ran (their program
            # failed between start and done) are of a closed runtime; drop
            # them and the sums they hold.
            _tickets.clear()
            _owner = runtime
        ticket = 0
        while ticket == 0 or ticket in _tickets:
            ticket = next(_next) % TICKETS
        _tickets[ticket] = (handle, runtime.timeline)
    if runtime.timeline is not None:
        runtime.timeline.span("start", "device", began, timeline.now())
    return np.int32(ticket)


def done(ticket) -> tuple[np.ndarray, ...]:
    """Waits for the sums of a ticket from `start`."""
    began = timeline.now()
    with _lock:
        handle, trace = _tickets.pop(int(ticket), (None, None))
    if handle is None:
        raise errors.JaxpsError(
            f"push_pull ticket {int(ticket)} is unknown: its start did not run "
            "in this process, or its result was already taken."
        )
    try:
        return tuple(handle.wait())
    finally:
        if trace is not None:
            trace.span("done", "device", began, timeline.now())
