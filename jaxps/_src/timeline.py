"""A Chrome/Perfetto trace of what each chunk did, and its summary.

With ``trace_dir`` set (``JAXPS_TRACE_DIR``), every worker writes
``<trace_dir>/jaxps-rank<r>.trace.json`` at shutdown. Open it at
ui.perfetto.dev or chrome://tracing. Rows ("threads") are:

- ``device``: the host callbacks of the jitted step: ``start`` (device to host
  copy and hand-off) and ``done`` (waiting for the sums, then host to device);
- ``push_pull``: one span per push_pull, from hand-off to the last sum;
- ``server <address>``: per chunk, ``queue`` (waiting for credit), ``push``
  (upload and server-side summation of this rank's part) and ``pull`` (until
  the sum of all ranks arrives).
"""

from __future__ import annotations

import json
import os
import threading
import time

# Events are stamped with a monotonic clock shifted to wall-clock time, so
# the traces of different ranks line up (exactly on one machine, as well as
# the clocks are synchronized across machines).
_WALL_OFFSET = time.time() - time.perf_counter()


def now() -> float:
    """The clock of trace events (seconds)."""
    return time.perf_counter()


class Timeline:
    """Collects trace events in memory and writes them as JSON on `close`.

    Args:
      path: output file.
      rank: the worker's rank (the trace's process id).
      max_events: events beyond this many are dropped (and counted).
    """

    def __init__(self, path: str, rank: int, max_events: int = 500_000):
        self.path = path
        self.rank = rank
        self.max_events = max_events
        self.dropped = 0
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def span(
        self,
        name: str,
        row: str,
        start: float,
        end: float,
        **args,
    ) -> None:
        """Records a complete event from `start` to `end` (`now()` times)."""
        event = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": row,
            "ts": (start + _WALL_OFFSET) * 1e6,
            "dur": max(0.0, end - start) * 1e6,
        }
        if args:
            event["args"] = args
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(event)
            else:
                self.dropped += 1

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        """Writes the trace file."""
        meta = {
            "name": "process_name",
            "ph": "M",
            "pid": self.rank,
            "args": {"name": f"jaxps worker {self.rank}"},
        }
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(
                {
                    "traceEvents": [meta, *self.events()],
                    "displayTimeUnit": "ms",
                    "otherData": {"dropped_events": self.dropped},
                },
                f,
            )


def union_seconds(spans: list[dict]) -> float:
    """Seconds covered by at least one of `spans` (trace events with ``ts``
    and ``dur`` in microseconds): overlapping spans count once."""
    total, reach = 0.0, float("-inf")
    for e in sorted(spans, key=lambda e: e["ts"]):
        begin, end = e["ts"], e["ts"] + e["dur"]
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total / 1e6


def summarize(
    events: list[dict],
    since: float | None = None,
    until: float | None = None,
) -> dict:
    """Communication time, the part hidden behind compute, and stage totals.

    A push_pull is in flight from its ``start`` hand-off to its last sum;
    the step only waits for it during ``done``. The overlap is the share of
    in-flight time that the device spent on other work instead of waiting.
    Several push_pulls may be in flight at once (`jaxps.value_and_grad`
    starts one per gradient leaf during the backward pass, and several
    ``done`` callbacks may wait at the same time): communication and waiting
    are the time *some* push_pull was in flight, or some ``done`` waited
    (the union of the spans). With one push_pull at a time that is the sum.

    Args:
      events: the trace events.
      since: only count spans starting at or after this wall-clock time
        (seconds since the epoch), e.g. to skip warm-up steps.
      until: only count spans starting before this wall-clock time.

    Returns:
      ``comm_s`` (seconds some push_pull was in flight), ``exposed_s``
      (seconds some ``done`` waited), ``overlap`` (1 - exposed/comm), the
      plain sums of the spans ``in_flight_sum_s`` and ``done_sum_s``, the
      counts ``push_pulls`` and ``dones``, and per chunk stage (and
      ``start``), ``<stage>_s`` totals.
    """
    if since is not None:
        events = [e for e in events if e.get("ts", 0) >= since * 1e6]
    if until is not None:
        events = [e for e in events if e.get("ts", 0) < until * 1e6]
    flights = [e for e in events if e.get("name") == "in_flight"]
    dones = [
        e
        for e in events
        if e.get("name") == "done" and e.get("tid") == "device"
    ]
    comm, exposed = union_seconds(flights), union_seconds(dones)
    out = {"comm_s": comm, "exposed_s": exposed}
    out["overlap"] = 1.0 - min(exposed, comm) / comm if comm else 0.0
    out["in_flight_sum_s"] = sum(e["dur"] for e in flights) / 1e6
    out["done_sum_s"] = sum(e["dur"] for e in dones) / 1e6
    out["push_pulls"] = len(flights)
    out["dones"] = len(dones)
    for stage in ("queue", "push", "pull", "start"):
        out[f"{stage}_s"] = (
            sum(e["dur"] for e in events if e.get("name") == stage) / 1e6
        )
    return out


def load(path: str) -> list[dict]:
    """Reads the events of a trace file."""
    with open(path) as f:
        return json.load(f)["traceEvents"]
