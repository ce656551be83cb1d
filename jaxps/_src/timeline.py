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


def summarize(events: list[dict], since: float | None = None) -> dict:
    """Communication time, the part hidden behind compute, and stage totals.

    A push_pull is in flight from its ``start`` hand-off to its last sum;
    the step only waits for it during ``done``. The overlap is the share of
    in-flight time that the device spent on other work instead of waiting.

    Args:
      events: the trace events.
      since: only count spans starting at or after this wall-clock time
        (seconds since the epoch), e.g. to skip warm-up steps.

    Returns:
      ``comm_s`` (total in-flight seconds), ``exposed_s`` (seconds spent
      waiting in ``done``), ``overlap`` (1 - exposed/comm) and, per chunk
      stage, ``<stage>_s`` totals.
    """
    if since is not None:
        events = [e for e in events if e.get("ts", 0) >= since * 1e6]
    comm = sum(e["dur"] for e in events if e.get("name") == "in_flight")
    exposed = sum(
        e["dur"]
        for e in events
        if e.get("name") == "done" and e.get("tid") == "device"
    )
    out = {"comm_s": comm / 1e6, "exposed_s": exposed / 1e6}
    out["overlap"] = 1.0 - min(exposed, comm) / comm if comm else 0.0
    for stage in ("queue", "push", "pull", "start"):
        out[f"{stage}_s"] = (
            sum(e["dur"] for e in events if e.get("name") == stage) / 1e6
        )
    return out


def load(path: str) -> list[dict]:
    """Reads the events of a trace file."""
    with open(path) as f:
        return json.load(f)["traceEvents"]
