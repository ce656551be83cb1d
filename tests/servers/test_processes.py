"""``jaxps-server --processes P``: P server processes on one host.

They listen on PORT..PORT+P-1 (or P free ports), print one ready line each,
sum for the workers like P servers and stop together.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxps._src.config import Config
from jaxps._src.launch import process
from jaxps._src.runtime import Runtime

START_TIMEOUT = 60.0


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Waits up to `timeout` s; returns the pids still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if not gone(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if not gone(p)]


def consecutive_free_ports(count: int) -> int:
    """A port p such that p..p+count-1 are free on 127.0.0.1 now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports")


class Supervisor:
    """``python -m jaxps.servers --processes P`` and its addresses."""

    def __init__(self, processes: int, num_workers: int, *flags, port=0):
        self.child = process.Child(
            "jaxps-server",
            process.server_argv(
                num_workers,
                "--processes",
                str(processes),
                *flags,
                port=port,
            ),
        )
        try:
            self.addresses = process.server_addresses(
                self.child, processes, time.monotonic() + START_TIMEOUT
            )
        except (RuntimeError, TimeoutError):
            self.child.stop()
            raise
        self.pids = children_of(self.child.proc.pid)

    def stop(self) -> None:
        self.child.stop(10)


@pytest.fixture
def supervisor():
    started = []

    def start(*args, **kwargs) -> Supervisor:
        sup = Supervisor(*args, **kwargs)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_two_workers_sum_exactly_then_sigterm_stops_all(supervisor, transport):
    sup = supervisor(2, 2)
    assert len(set(sup.addresses)) == 2
    assert len(sup.pids) == 2
    sizes = [1, 1000, 40_000]  # one chunk, then several on both processes

    def work(rank: int):
        cfg = Config(
            servers=tuple(sup.addresses),
            num_workers=2,
            worker_rank=rank,
            partition_bytes=4096,
            transport=transport,
        )
        rt = Runtime(cfg)
        try:
            # One host: its share is split between its processes.
            assert rt.weights == [0.5, 0.5]
            out = []
            for step in range(3):
                arrays = [
                    np.arange(s, dtype=np.float32) * (rank + 1) + step
                    for s in sizes
                ]
                names = [f"t{s}" for s in sizes]
                out.append(
                    rt.push_pull_async(names, arrays, average=False).wait()
                )
            return out
        finally:
            rt.close()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = [f.result(90) for f in [pool.submit(work, r) for r in (0, 1)]]
    for steps in results:
        for step, outs in enumerate(steps):
            for size, got in zip(sizes, outs):
                expected = np.arange(size, dtype=np.float32) * 3 + 2 * step
                np.testing.assert_array_equal(got, expected)

    os.kill(sup.child.proc.pid, signal.SIGTERM)  # the supervisor only
    assert sup.child.wait(time.monotonic() + 20) == 0
    assert wait_gone(sup.pids) == []


@pytest.mark.timeout(60)
def test_fixed_port_gives_consecutive_ports(supervisor):
    base = consecutive_free_ports(3)
    sup = supervisor(3, 1, port=base)
    ports = sorted(int(a.rsplit(":", 1)[1]) for a in sup.addresses)
    assert ports == [base, base + 1, base + 2]


@pytest.mark.timeout(60)
def test_a_process_that_dies_ends_the_others(supervisor):
    sup = supervisor(2, 2)
    victim, other = sup.pids
    os.kill(victim, signal.SIGKILL)
    assert sup.child.wait(time.monotonic() + 20) == 1
    assert "ended with code -9" in sup.child.stderr_tail()
    assert wait_gone([other]) == []


@pytest.mark.timeout(60)
def test_processes_end_when_the_supervisor_is_killed(supervisor):
    sup = supervisor(2, 2)
    os.kill(sup.child.proc.pid, signal.SIGKILL)
    assert wait_gone(sup.pids) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "0"], "--processes must be >= 1, got 0"),
        (
            ["--processes", "3", "--port", "65534"],
            "--port 65534 with --processes 3 needs ports up to 65536",
        ),
    ],
)
def test_bad_processes_flags_are_named(flags, message):
    out = subprocess.run(
        [sys.executable, "-m", "jaxps.servers", "--num-workers", "1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert message in out.stderr
