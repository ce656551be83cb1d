"""push_pull, broadcast, sync_gradients and the optimizers in JAX programs.

Each test starts real servers and one worker process per rank that runs
`scenarios.py`, which checks its results against the expected sums.
"""

import os
import pathlib
import subprocess
import sys

import pytest

SCENARIOS = pathlib.Path(__file__).with_name("scenarios.py")
ALL = [
    "jit",
    "grad",
    "vmap",
    "shard_map",
    "pmap",
    "broadcast",
    "optimizer_equivalence",
    "accumulation",
    "compression",
    "sync_gradients",
    "sync_gradients_accumulation",
    "flax",
]


def run_job(servers, num_workers, names, tmp_path, timeout=240):
    env = dict(
        os.environ,
        JAXPS_SERVERS=",".join(s.address for s in servers),
        JAXPS_NUM_WORKERS=str(num_workers),
        JAXPS_TIMEOUT="30",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    procs = []
    for rank in range(num_workers):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCENARIOS), *names],
                env=dict(env, JAXPS_WORKER_RANK=str(rank)),
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        for name in names:
            assert f"ok {name}" in out, f"rank {rank}: {name} missing:\n{out}"


@pytest.mark.timeout(300)
def test_two_workers_two_servers(start_servers, tmp_path):
    servers = start_servers(2, 2, "--round-timeout", "30")
    run_job(servers, 2, ALL, tmp_path)


@pytest.mark.timeout(300)
def test_one_worker_through_a_server(start_servers, tmp_path):
    servers = start_servers(1, 1)
    run_job(servers, 1, ["jit", "grad", "vmap", "shard_map", "pmap"], tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_workers(start_servers, tmp_path):
    servers = start_servers(2, 4, "--round-timeout", "30")
    run_job(servers, 4, ["jit", "shard_map", "optimizer_equivalence"], tmp_path)


@pytest.mark.timeout(300)
def test_async_mode_converges(start_servers, tmp_path):
    servers = start_servers(2, 2, "--async")
    run_job(servers, 2, ["async"], tmp_path)
