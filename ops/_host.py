"""Host side of the push_pull op: what the XLA host callbacks run.

`start` hands the device's arrays to the worker runtime and returns a ticket
at once, so the device program goes on while the chunks travel; `done` waits
for the ticket's sums. A ticket is a small integer that flows from the start
callback to the done callback as data, which orders the two in XLA.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading

import numpy as np

from jaxps._src import errors, plan, state, timeline

_lock = threading.Lock()
_tickets: dict[int, object] = {}
#: the runtime the tickets are of; a new init drops the old one's
_owner = None
_next = itertools.count(1)
# Tickets stay below 2**24, so that a float32 holds one exactly (the
# overlapped backward pass carries them as cotangents, see _overlap.py).
TICKETS = 1 << 24


#: On the CPU, the leaves of a dtype below this many bytes are fused (0:
#: none are). Each operand and result of a host callback costs its own
#: marshalling, NumPy array and runtime bookkeeping; a fused leaf costs two
#: more copies on the device (into the operand, out of the sum). Measured
#: without servers, in turns (median ms per jitted push_pull, unfused /
#: fused): 200 leaves of 1.3 KiB 3.2 / 1.7, of 10 KiB 5.3 / 5.0, of 20
#: KiB 8.6 / 11.5, of 82 KiB 31.6 / 40.0.
CPU_FUSE_BYTES = 16 << 10

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


@dataclasses.dataclass(frozen=True, eq=False)
class FusedLayout:
    """How the leaves of a push_pull cross to the host: per operand of the
    callbacks, one leaf as it is, or several leaves of one dtype flattened
    and concatenated (a *fused* operand, pushed as one tensor).

    Attributes:
      names: per leaf, its name (without the device's shard suffix).
      groups: per operand, the indices of its leaves, in order.
      shapes: per leaf, its shape.
      dtypes: per leaf, its dtype.
    """

    names: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    # shard -> (operand names, call check), filled on first use
    _at: dict = dataclasses.field(default_factory=dict, repr=False)
    # leaves' priorities -> the operands'
    _priorities: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def operand_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The (shape, dtype) of each operand (and of its sum)."""
        return [
            (
                self.shapes[g[0]]
                if len(g) == 1
                else (sum(math.prod(self.shapes[i]) for i in g),),
                self.dtypes[g[0]],
            )
            for g in self.groups
        ]

    def fuse(self, arrays) -> list:
        """The operands of the leaves `arrays` (traced)."""
        import jax.numpy as jnp  # the host side needs numpy only

        return [
            arrays[g[0]]
            if len(g) == 1
            else jnp.concatenate([jnp.ravel(arrays[i]) for i in g])
            for g in self.groups
        ]

    def unfuse(self, operands) -> list:
        """The leaves of the operands' sums (traced)."""
        leaves = [None] * len(self.shapes)
        for group, operand in zip(self.groups, operands):
            offset = 0
            for i in group:
                size = math.prod(self.shapes[i])
                if len(group) == 1:
                    leaves[i] = operand
                else:
                    piece = operand[offset : offset + size]
                    leaves[i] = piece.reshape(self.shapes[i])
                offset += size
        return leaves

    def priorities(self, priorities: tuple[int, ...]) -> tuple[int, ...]:
        """Per operand, the highest priority of its leaves."""
        found = self._priorities.get(priorities)
        if found is None:
            found = tuple(max(priorities[i] for i in g) for g in self.groups)
            self._priorities[priorities] = found
        return found

    def at(
        self, shard: int, call: str | None
    ) -> tuple[tuple[str, ...], object]:
        """The operands' tensor names on device `shard`, and the call check
        of the leaves (computed once per shard).

        A fused operand is named after its first leaf and how many follow
        (``"grads['a']:float32[3]+199"``). The check describes every leaf,
        so ranks whose trees differ in any leaf are told which, even where
        the fused operands are of one size.
        """
        found = self._at.get((shard, call))
        if found is None:
            leaf_names = shard_names(self.names, shard)
            names = tuple(
                leaf_names[g[0]]
                if len(g) == 1
                else f"{leaf_names[g[0]]}+{len(g) - 1}"
                for g in self.groups
            )
            fused = [g for g in self.groups if len(g) > 1]
            check = plan.call_check(
                leaf_names,
                self.shapes,
                self.dtypes,
                None if call is None else f"{call}@{shard}",
                # ranks on other platforms fuse other leaves: named at once
                crossing="fused leaves "
                + " ".join(",".join(map(str, g)) for g in fused)
                if fused
                else "",
            )
            found = self._at[(shard, call)] = (names, check)
        return found


def layout_of(names, avals, platforms) -> FusedLayout | None:
    """The `FusedLayout` of leaves named `names`, of shapes and dtypes
    `avals` (arrays or `jax.ShapeDtypeStruct`s), in a program for
    `platforms`; None where every leaf crosses as it is.

    Off the CPU every dtype's leaves are fused, first seen first: JAX's GPU
    callback makes one device-to-host copy per operand. On the CPU, the
    leaves below `CPU_FUSE_BYTES` are (where a dtype has two of them).
    The operands are ordered by their first leaf.
    """
    shapes = tuple(tuple(a.shape) for a in avals)
    dtypes = tuple(np.dtype(a.dtype) for a in avals)
    limit = CPU_FUSE_BYTES if tuple(platforms) == ("cpu",) else math.inf
    small: dict = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        if math.prod(shape) * dtype.itemsize < limit:
            small.setdefault(dtype, []).append(i)
    everywhere = limit == math.inf
    fused = [tuple(g) for g in small.values() if len(g) > 1 or everywhere]
    if not fused:
        return None
    alone = set(range(len(shapes))).difference(*map(set, fused))
    groups = sorted(fused + [(i,) for i in alone], key=lambda g: g[0])
    return FusedLayout(tuple(names), tuple(groups), shapes, dtypes)


def fuse(arrays, platforms, names):
    """The callback operands of `arrays` (traced), and their layout (None:
    the operands are `arrays`); see `layout_of`."""
    layout = layout_of(names, arrays, platforms)
    if layout is None:
        return list(arrays), None
    return layout.fuse(arrays), layout


#: (names, shard) -> `shard_names`, made once per push_pull and device
_shard_names: dict[tuple[tuple[str, ...], int], tuple[str, ...]] = {}


def shard_names(names: tuple[str, ...], shard: int) -> tuple[str, ...]:
    """Per-device tensor names: each device pushes its own shard."""
    found = _shard_names.get((names, shard))
    if found is None:
        if len(_shard_names) >= 4096:  # traces come and go
            _shard_names.clear()
        found = tuple(f"{n}@{shard}" for n in names)
        _shard_names[(names, shard)] = found
    return found


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
    device's shard suffix. With a `layout`, `arrays` are its operands (see
    `fuse`), each pushed as one tensor, and `done` returns their sums;
    `from_callback` says they are a host callback's operands (see
    `_kept`).
    """
    began = timeline.now()
    runtime = state.runtime()
    copies = [
        a if from_callback and a.flags.owndata else _kept(a, from_callback)
        for a in arrays
    ]
    shard = int(shard)
    check = None
    if layout is None:
        wire_names = shard_names(names, shard)
    else:
        wire_names, check = layout.at(shard, call)
        priorities = layout.priorities(priorities)
    handle = runtime.push_pull_async(
        wire_names,
        copies,
        average=average,
        priorities=priorities,
        mode=mode,
        call=None if call is None else f"{call}@{shard}",
        donate=True,  # its own copies
        check=check,
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
