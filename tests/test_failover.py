"""Server failover: a server killed (-9) and restarted mid-job loses no step.

Real servers and 2 real worker processes; a server is killed at a given
step and a new one started on the same port. Every sum must stay exact.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxps._src import process

STEPS = 60

WORKER = textwrap.dedent(
    f"""
    import sys, time, numpy as np
    from jaxps._src import state
    import jaxps

    jaxps.init()
    rt, rank, n = state.runtime(), jaxps.rank(), jaxps.size()
    names = ["small", "big", "ints"]
    began = time.monotonic()
    for step in range({STEPS}):
        arrays = [
            np.full(100, step + 10.0 * rank, np.float32),
            np.arange(300_000, dtype=np.float64) * (rank + 1) + step,
            np.full(7, step * (rank + 1), np.int32),
        ]
        outs = rt.push_pull_async(names, arrays, average=False).wait()
        want = [
            sum(np.full(100, step + 10.0 * r, np.float32) for r in range(n)),
            sum(np.arange(300_000, dtype=np.float64) * (r + 1) + step
                for r in range(n)),
            sum(np.full(7, step * (r + 1), np.int32) for r in range(n)),
        ]
        for out, w in zip(outs, want):
            np.testing.assert_array_equal(out, w)
        print("step", step, round(time.monotonic() - began, 3), flush=True)
        time.sleep(0.02)
    recoveries = [r for t in rt._transports for r in t.recoveries]
    print("recoveries", *recoveries, flush=True)
    jaxps.shutdown()
    print("ok", flush=True)
    """
)


def _start_server(port, num_workers=2):
    child = process.Child(
        "jaxps-server", process.server_argv(num_workers, port=port)
    )
    address = process.server_address(child, time.monotonic() + 60)
    return child, address


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "transport, kill_at", [("auto", 5), ("grpc", 30), ("tcp", 17)]
)
def test_killed_and_restarted_server_loses_no_step(
    tmp_path, transport, kill_at
):
    children = []
    try:
        first, address = _start_server(0)
        children.append(first)
        other, other_address = _start_server(0)
        children.append(other)
        port = int(address.rpartition(":")[2])
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        env = dict(
            os.environ,
            JAXPS_SERVERS=f"{address},{other_address}",
            JAXPS_NUM_WORKERS="2",
            JAXPS_TRANSPORT=transport,
            JAXPS_TIMEOUT="20",
            JAXPS_PARTITION_BYTES=str(256 * 1024),
        )
        workers = [
            subprocess.Popen(
                [sys.executable, str(script)],
                env=dict(env, JAXPS_WORKER_RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
            )
            for r in range(2)
        ]
        out0 = []
        for line in workers[0].stdout:
            out0.append(line)
            if line.startswith(f"step {kill_at} "):
                break
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        killed = time.monotonic()
        restarted, _ = _start_server(port)
        children.append(restarted)
        restart_took = time.monotonic() - killed
        rest0, _ = workers[0].communicate(timeout=120)
        out1, _ = workers[1].communicate(timeout=30)
        outs = ["".join(out0) + rest0, out1]
        for rank, (w, out) in enumerate(zip(workers, outs)):
            assert w.returncode == 0, f"rank {rank}:\n{out}"
            assert f"step {STEPS - 1} " in out and "ok" in out, out
        recoveries = [
            float(x)
            for line in outs[0].splitlines()
            if line.startswith("recoveries")
            for x in line.split()[1:]
        ]
        assert recoveries, outs[0]
        times = [
            float(line.split()[2])
            for line in outs[0].splitlines()
            if line.startswith("step ")
        ]
        stall = max(b - a for a, b in zip(times, times[1:]))
        print(
            f"{transport}, kill at step {kill_at}: the new server was up "
            f"{restart_took:.2f} s after the kill; the longest step took "
            f"{stall:.2f} s; worker 0 went on {max(recoveries):.3f} s after "
            "its failure was detected"
        )
    finally:
        for w in locals().get("workers", []):
            if w.poll() is None:
                w.kill()
                w.wait()
        for child in children:
            child.stop(10)
