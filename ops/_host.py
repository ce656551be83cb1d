"""Host side of the push_pull op: what the XLA host callbacks run.

`start` hands the device's arrays to the worker runtime and returns a ticket
at once, so the device program goes on while the chunks travel; `done` waits
for the ticket's sums. A ticket is a small integer that flows from the start
callback to the done callback as data, which orders the two in XLA.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from jaxps._src import errors, state, timeline

_lock = threading.Lock()
_tickets: dict[int, object] = {}
_next = itertools.count(1)
# Tickets stay below 2**24, so that a float32 holds one exactly (the
# overlapped backward pass carries them as cotangents, see _overlap.py).
TICKETS = 1 << 24


def shard_names(names: tuple[str, ...], shard: int) -> list[str]:
    """Per-device tensor names: each device pushes its own shard."""
    return [f"{n}@{shard}" for n in names]


def start(
    names, average, priorities, mode, shard, *arrays, call=None
) -> np.ndarray:
    """Starts push_pull of `arrays`; returns a ticket for `done`.

    `mode` is the push_pull's (``"sync"`` or ``"async"``); the runtime
    checks it against the servers it is connected to now. `call` names the
    call's check (default: from `names`, see `plan.call_name`), before the
    device's shard suffix.
    """
    began = timeline.now()
    runtime = state.runtime()
    # The callback's arrays may alias device memory that is only valid during
    # the call: copy them (this is the device-to-host copy).
    copies = [np.array(a, copy=True) for a in arrays]
    handle = runtime.push_pull_async(
        shard_names(names, int(shard)),
        copies,
        average=average,
        priorities=priorities,
        mode=mode,
        call=None if call is None else f"{call}@{int(shard)}",
        donate=True,  # its own copies
    )
    with _lock:
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
