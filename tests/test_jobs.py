"""Servers that outlive jobs: job incarnations, freed state, bounded memory.

Long-running `jaxps-server` processes (as in docs/clusters.md)
serve job after job; workers are real processes or real Runtimes.
"""

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest

from jaxps._src.config import Config
from jaxps._src.runtime import Runtime
from jaxps.servers import _codec, _wire
from jaxps.servers import jaxps_pb2 as pb

# A worker that runs two inits in one process, reusing names: the second
# init must start at round 0 of a new incarnation and never see the first's
# sums.
WORKER = textwrap.dedent(
    """
    import sys, numpy as np, jaxps
    rank, n, offset = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    for init in range(2):
        jaxps.init()
        for step in range(3):
            x = np.full(300_000, offset + 10 * init + step + rank, np.float32)
            got = jaxps.push_pull_numpy("w", x, average=False)
            want = n * (offset + 10 * init + step) + n * (n - 1) / 2
            assert np.all(got == want), (init, step, got[:3], want)
        jaxps.shutdown()
    print("OK", flush=True)
    """
)


def run_job(tmp_path, servers, n, offset, **env):
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    base = dict(
        os.environ,
        JAXPS_SERVERS=",".join(s.address for s in servers),
        JAXPS_NUM_WORKERS=str(n),
        JAXPS_TIMEOUT="20",
        **env,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(n), str(offset)],
            env=dict(base, JAXPS_WORKER_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(n)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "OK" in out, out[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_jobs_one_after_another_on_long_running_servers(
    start_servers, tmp_path, transport
):
    # The default job id for both jobs, servers started by hand without
    # --job-id, each job calling init/shutdown twice with the same names.
    servers = start_servers(2, 2)
    env = dict(JAXPS_TRANSPORT=transport)
    if transport != "shm":
        env["JAXPS_SHM_BYTES"] = "0"
    run_job(tmp_path, servers, 2, 0.0, **env)
    run_job(tmp_path, servers, 2, 100.0, **env)


class StatusReader:
    """Keeps the last status line a server prints (``--status-interval``)."""

    def __init__(self, server):
        self.last = ""
        self._thread = threading.Thread(
            target=self._read, args=(server.proc.stdout,), daemon=True
        )
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            if line.startswith("jaxps-server "):
                self.last = line

    def keys(self) -> int:
        time.sleep(1.2)  # a fresh line
        match = re.search(r"(\d+) keys", self.last)
        assert match, self.last
        return int(match.group(1))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_keys_of_a_finished_job_are_freed(start_servers):
    (server,) = start_servers(1, 1, "--status-interval", "0.5")
    status = StatusReader(server)
    # 20,000 keys: chunks of 64 bytes over the data channel
    cfg = Config(servers=(server.address,), partition_bytes=64, transport="tcp")
    xs = [np.full(16 * 5_000, i, np.float32) for i in range(4)]
    names = [f"k{i}" for i in range(4)]
    rss = []
    for job in range(2):
        rt = Runtime(cfg)
        try:
            outs = rt.push_pull_async(names, xs).wait()
            for out, x in zip(outs, xs):
                np.testing.assert_array_equal(out, x)
            if job == 0:
                assert status.keys() == 20_000
                peak = rss_mib(server.proc.pid)  # while holding the keys
        finally:
            rt.close()  # says Bye: the server frees the job's keys
        assert status.keys() == 0
        rss.append(rss_mib(server.proc.pid))
    print(
        f"server RSS holding job 1's keys: {peak:.0f} MiB, after job 1: "
        f"{rss[0]:.0f}, after job 2: {rss[1]:.0f}"
    )
    # Kept, 20,000 keys cost ~18 MiB more per job (100,000 cost ~90). How
    # much of job 1's freed memory glibc hands back varies (121-256 MiB of
    # 100,000 keys' seen), so job 2 is compared with job 1's peak: it must
    # have reused that memory (measured: 4-5 MiB below the peak).
    assert rss[1] - peak < 9, (peak, rss)


def _hello(channel, rank=0, n=1):
    return channel.unary_unary(
        "/jaxps.Summation/Hello",
        request_serializer=pb.HelloRequest.SerializeToString,
        response_deserializer=pb.HelloReply.FromString,
    )(
        pb.HelloRequest(
            version=_wire.PROTOCOL_VERSION,
            job_id="rogue",
            rank=rank,
            num_workers=n,
            init_id="rogue",
        ),
        timeout=10,
    )


@pytest.mark.timeout(120)
def test_unpulled_rounds_and_idle_jobs_are_freed(start_servers):
    (server,) = start_servers(
        1,
        1,
        "--round-timeout",
        "1",
        "--job-idle-timeout",
        "2",
        "--status-interval",
        "0.5",
    )
    status = StatusReader(server)
    base = rss_mib(server.proc.pid)
    x = np.ones(1 << 20, np.float32)  # 4 MiB
    with grpc.insecure_channel(
        server.address, options=_wire.channel_options(64 << 20)
    ) as channel:
        session = _hello(channel).session
        push = channel.unary_unary("/jaxps.Summation/Push")
        for key in range(64):  # 256 MiB of complete rounds nobody pulls
            h = pb.Header(
                version=_wire.PROTOCOL_VERSION,
                job_id="rogue",
                session=session,
                rank=0,
                key=key,
                round=0,
                dtype=pb.FLOAT32,
                length=x.size,
            )
            push(_codec.encode_push(h, x, _wire.fingerprint(x)), timeout=10)
    held = rss_mib(server.proc.pid)
    assert status.keys() == 64
    deadline = time.monotonic() + 20
    while status.keys() and time.monotonic() < deadline:
        pass
    freed = rss_mib(server.proc.pid)
    print(f"server RSS {base:.0f} MiB, {held:.0f} holding, {freed:.0f} freed")
    assert status.keys() == 0
    assert held - base > 200, (base, held)
    assert freed - base < 48, (base, held, freed)


@pytest.mark.timeout(60)
def test_memory_cap_refuses_with_resource_exhausted(start_servers):
    (server,) = start_servers(1, 1, "--max-memory", "8")
    cfg = Config(servers=(server.address,), transport="grpc", shm_bytes=0)
    rt = Runtime(cfg)
    try:
        rt.push_pull("small", np.ones(1 << 10, np.float32))
        with pytest.raises(Exception, match=r"--max-memory 8 MiB") as e:
            rt.push_pull("big", np.ones(4 << 20, np.float32))
        assert "RESOURCE_EXHAUSTED" in str(e.value)
    finally:
        rt.close()
