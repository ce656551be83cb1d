"""Helpers shared by the benchmark scripts: child processes and reporting.

Every child is a `jaxps._src.launch.process.Child`: started in its own session
(process group) with its output in a log file, so that a hung child can never
block the parent on a full pipe and can always be stopped, with all its
threads and children, by its group id.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

from jaxps._src.launch import process

MB = 1024 * 1024
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class Child(process.Child):
    """A child whose stdout and stderr go to ``<log_dir>/<name>.out``/``.err``.

    It runs in `log_dir` (so that ``-m`` imports the installed packages, not
    the caller's directory's) with our environment plus `env`.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: str,
        env: dict[str, str] | None = None,
    ):
        super().__init__(
            name,
            argv,
            env={**os.environ, **(env or {})},
            cwd=log_dir,
            log_dir=log_dir,
        )

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """Waits `timeout` s for a line starting with `prefix`; returns the
        rest of it (`process.Child.wait_for_line` takes a deadline)."""
        return super().wait_for_line(prefix, time.monotonic() + timeout)


@contextlib.contextmanager
def children() -> Iterator[list[process.Child]]:
    """Yields a list to put children in; stops them all on exit."""
    started: list[process.Child] = []
    try:
        yield started
    finally:
        process.stop_all(reversed(started))


def jaxps_job(
    argv: Sequence[str],
    log_dir: str,
    *,
    servers: int = 1,
    workers: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> list[dict]:
    """Runs `argv` as `workers` ranks of one job against `servers`
    jaxps-servers on 127.0.0.1 (their JAXPS_* settings in the environment,
    with `env`); returns each rank's ``RESULT {json}`` line, parsed."""
    with children() as started:
        ports = [free_port() for _ in range(servers)]
        for i, port in enumerate(ports):
            server = Child(
                f"server{i}",
                ["jaxps-server", "--port", str(port)]
                + ["--num-workers", str(workers)],
                log_dir,
            )
            started.append(server)
            server.wait_for_line("jaxps-server listening", 60)
        pids = ",".join(str(server.proc.pid) for server in started)
        ranks = [
            Child(
                f"worker{rank}",
                argv,
                log_dir,
                {
                    SERVER_PIDS: pids,
                    "JAXPS_SERVERS": ",".join(f"{LOOPBACK}:{p}" for p in ports),
                    "JAXPS_NUM_WORKERS": str(workers),
                    "JAXPS_WORKER_RANK": str(rank),
                    **(env or {}),
                },
            )
            for rank in range(workers)
        ]
        started.extend(ranks)
        return [json.loads(r.wait_for_line("RESULT ", timeout)) for r in ranks]


#: What `jaxps_job` tells its workers: the process ids of its servers.
SERVER_PIDS = "BENCH_SERVER_PIDS"


def servers_cpu() -> float:
    """CPU seconds the servers of the `jaxps_job` this worker belongs to
    have used so far, in their threads alive now (0.0 outside one).

    The scheduler's nanoseconds (``/proc/PID/task/TID/schedstat``), not
    the 10 ms ticks of ``/proc/PID/stat``: a call of a few ms needs them.
    """
    total = 0
    for pid in filter(None, os.environ.get(SERVER_PIDS, "").split(",")):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # the thread ended
    return total / 1e9


def median(values: Sequence[float]) -> float:
    """The median of `values`."""
    return statistics.median(values)


class OtherLoad:
    """Measures how many cores processes other than ours kept busy.

    Busy CPU time of the whole machine (``/proc/stat``) minus the CPU time
    of this process and of its children that have been waited for, over
    wall time. Near 0 on a quiet machine; on a 2-core machine 1.0 means that
    something else took half of it, and the figures of that span are low.
    """

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        """(monotonic time, machine busy CPU s, our CPU s)."""
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal; guest is in user.
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / hz
        ours = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            ours += usage.ru_utime + usage.ru_stime
        return time.monotonic(), busy, ours

    def cores(self) -> float:
        """Cores used by other processes since this object was made."""
        now, busy, ours = self._sample()
        then, busy0, ours0 = self._start
        wall = max(now - then, 1e-9)
        return max(0.0, (busy - busy0) - (ours - ours0)) / wall


def load_average() -> str:
    """The 1-minute load average, to tell a disturbed run from a quiet one."""
    return f"{os.getloadavg()[0]:.2f}"


def log(message: str) -> None:
    """Prints a progress line to stderr (stdout carries the results)."""
    print(message, file=sys.stderr, flush=True)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Formats rows as a Markdown table; the first column is left-aligned."""
    widths = [
        max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))
    ]

    def line(cells):
        return (
            "| "
            + " | ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":")
            for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def top_frames(
    raw_path: str, count: int = 12, exclude: Sequence[str] = ()
) -> list[tuple[str, float]]:
    """Reads a py-spy ``--format raw`` file; returns the hottest leaf frames.

    Each line of the file is ``frame;frame;...;leaf COUNT``. A frame is
    ``function (file:line)``; the line number is dropped so that samples of
    one function add up. Samples whose stack contains any of the `exclude`
    substrings (say the benchmark's own setup) are left out. Returns
    ``(function (file), share of the samples kept)``.
    """
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, samples = line.rstrip("\n").rpartition(" ")
            if not stack or not samples.isdigit():
                continue
            if any(word in stack for word in exclude):
                continue
            leaf = stack.split(";")[-1]
            name, _, where = leaf.partition(" (")
            where = where.rstrip(")").rsplit(":", 1)[0]
            leaves[f"{name} ({os.path.basename(where)})"] += int(samples)
            total += int(samples)
    return [(frame, n / total) for frame, n in leaves.most_common(count)]
