"""Failure detection with real processes: nothing hangs, errors name culprits.

Timeouts are short (3 s) so that the bounds (detection within 2x the
timeout) are checked in seconds.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxps import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime

TIMEOUT = 3.0

WORKER = textwrap.dedent(
    """
    import sys, time, numpy as np, jaxps
    from jaxps import errors
    jaxps.init()
    x = np.ones(4 * 1024 * 1024, np.float32)
    try:
        for step in range(1000):
            jaxps.push_pull_numpy("x", x)
            print("step", step, flush=True)
    except errors.JaxpsError as err:
        print("ERROR", type(err).__name__, time.time(), err, flush=True)
        sys.exit(3)
    """
)


def start_worker(tmp_path, servers, rank, n, transport="auto", timeout=TIMEOUT):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(
        os.environ,
        JAXPS_SERVERS=",".join(s.address for s in servers),
        JAXPS_NUM_WORKERS=str(n),
        JAXPS_WORKER_RANK=str(rank),
        JAXPS_TIMEOUT=str(timeout),
        JAXPS_TRANSPORT=transport,
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(proc, prefix, timeout=60):
    """Returns the first line of `proc` starting with `prefix`."""
    found = []

    def read():
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    assert found, f"no line starting with {prefix!r} within {timeout} s"
    return found[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_killed_worker_is_named_by_survivors(
    start_servers, tmp_path, transport
):
    n = 3
    servers = start_servers(2, n, "--round-timeout", str(TIMEOUT))
    procs = [start_worker(tmp_path, servers, r, n, transport) for r in range(n)]
    try:
        for p in procs:
            wait_for_line(p, "step 3")
        procs[1].kill()  # kill -9 mid-job
        killed_at = time.time()
        for rank in (0, 2):
            line = wait_for_line(procs[rank], "ERROR", timeout=4 * TIMEOUT)
            _, kind, at, message = line.split(" ", 3)
            assert kind == "RoundTimeoutError", line
            assert "rank(s) [1]" in message, line
            print(
                f"rank {rank} named the killed worker after "
                f"{float(at) - killed_at:.2f} s"
            )
            assert float(at) - killed_at < 2 * TIMEOUT, line
            assert procs[rank].wait(10) == 3
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_killed_worker_is_named_under_the_servers_default_timeout(
    start_servers, tmp_path, transport
):
    # Servers started by hand (default --round-timeout 60 s), workers with
    # JAXPS_TIMEOUT=3: the servers answer at the worker's timeout.
    servers = start_servers(1, 2)
    procs = [
        start_worker(tmp_path, servers, r, 2, transport, timeout=3.0)
        for r in range(2)
    ]
    try:
        for p in procs:
            wait_for_line(p, "step 3")
        procs[1].kill()
        killed_at = time.time()
        line = wait_for_line(procs[0], "ERROR", timeout=30)
        _, kind, at, message = line.split(" ", 3)
        print(f"rank 0 named rank 1 after {float(at) - killed_at:.2f} s")
        assert kind == "RoundTimeoutError", line
        assert "rank(s) [1]" in message, line
        assert float(at) - killed_at < 6, line
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def run_pair(
    servers, fn, timeout=TIMEOUT, transport="auto", recovery_window=0.0
):
    """Runs fn(runtime) for ranks 0 and 1 in threads; returns results.

    Failover is off unless `recovery_window` says otherwise: these tests
    are about how a fault that is not recovered is reported."""
    results = [None, None]

    def work(rank):
        cfg = Config(
            servers=tuple(s.address for s in servers),
            num_workers=2,
            worker_rank=rank,
            timeout=timeout,
            partition_bytes=1 << 20,  # 4 chunks: both servers get some
            transport=transport,
            recovery_window=recovery_window,
        )
        rt = Runtime(cfg)
        try:
            results[rank] = fn(rt)
        except BaseException as err:  # noqa: BLE001 - inspected by the test
            results[rank] = err
        finally:
            rt.close()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return results


def loop_until_error(event):
    def fn(rt):
        x = np.ones(1024 * 1024, np.float32)
        for _ in range(10_000):
            rt.push_pull("x", x)
            event.set()
        return None

    return fn


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_dead_or_frozen_server_is_named(start_servers, how, transport):
    servers = start_servers(2, 2, "--round-timeout", str(TIMEOUT))
    victim = servers[1]
    running = threading.Event()
    stopped_at = []

    def stop_server():
        running.wait(30)
        stopped_at.append(time.monotonic())
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        os.kill(victim.proc.pid, sig)

    threading.Thread(target=stop_server, daemon=True).start()
    try:
        results = run_pair(
            servers, loop_until_error(running), transport=transport
        )
        took = time.monotonic() - stopped_at[0]
    finally:
        if how == "freeze":
            os.kill(victim.proc.pid, signal.SIGCONT)
    for err in results:
        assert isinstance(err, errors.JaxpsError), results
    # Every worker names the server, or the rank that failed on it: a rank
    # that was done with the victim in that round (or never reached it)
    # hears from the healthy server only that the other rank, stuck on or
    # failed by the victim, did not push.
    named = [victim.address in str(err) for err in results]
    assert any(named), results
    for rank, (err, names_victim) in enumerate(zip(results, named)):
        if not names_victim:
            assert isinstance(err, errors.RoundTimeoutError), err
            assert f"rank(s) [{1 - rank}]" in str(err), err
            assert named[1 - rank], results
    print(f"{how}: workers named the server after {took:.2f} s")
    # a dead server is seen at once; a frozen one by its deadline
    assert took < (1 if how == "kill" else 2.0) * TIMEOUT + 2.5, took


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_restarted_server_fails_clearly(start_servers, transport):
    servers = start_servers(1, 2, "--round-timeout", str(TIMEOUT))
    port = servers[0].address.rsplit(":", 1)[1]
    running = threading.Event()

    def restart():
        running.wait(30)
        time.sleep(0.2)
        servers[0].stop(signal.SIGKILL)
        servers[:] = start_servers(
            1, 2, "--port", port, "--round-timeout", str(TIMEOUT)
        )

    threading.Thread(target=restart, daemon=True).start()
    # A long timeout: the pushes' retries must outlast the new server's
    # start-up (seconds on a loaded machine) to reach it.
    results = run_pair(
        servers[:], loop_until_error(running), timeout=20.0, transport=transport
    )
    for err in results:
        assert isinstance(
            err, (errors.ServerRestartedError, errors.ServerUnavailableError)
        ), repr(err)
    assert any(isinstance(e, errors.ServerRestartedError) for e in results), (
        results
    )


@pytest.mark.timeout(120)
def test_dead_server_not_back_within_the_recovery_window_is_named(
    start_servers,
):
    # With failover on, a killed server that never comes back ends the job
    # once the recovery window is over, naming the server and the window.
    # The window is well inside the round timeout: a rank that was still
    # pulling the last round from the victim never pushes the next one to
    # the healthy server, whose wait for it must not end first.
    window = 1.0
    servers = start_servers(2, 2, "--round-timeout", str(TIMEOUT))
    victim = servers[1]
    running = threading.Event()
    stopped_at = []

    def kill():
        running.wait(30)
        stopped_at.append(time.monotonic())
        os.kill(victim.proc.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    results = run_pair(
        servers, loop_until_error(running), recovery_window=window
    )
    took = time.monotonic() - stopped_at[0]
    for err in results:
        assert isinstance(err, errors.ServerUnavailableError), results
        assert victim.address in str(err), err
    assert any("recovery window (1 s)" in str(err) for err in results), results
    print(f"the workers gave the server up after {took:.2f} s")
    # a reconnect waits only for what is left of the window
    assert took < window + 2, took
