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
    "unused_result",
    "remat",
    "default_names",
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


def start_ranks(
    script,
    args,
    addresses,
    num_workers,
    cwd,
    *,
    timeout,
    jaxps_timeout=30,
    devices=4,
):
    """Runs ``python script *args`` once per rank of a job on the servers at
    `addresses`, each rank with `devices` forced CPU devices; returns each
    rank's (exit code, output)."""
    env = dict(
        os.environ,
        JAXPS_SERVERS=",".join(addresses),
        JAXPS_NUM_WORKERS=str(num_workers),
        JAXPS_TIMEOUT=str(jaxps_timeout),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=dict(env, JAXPS_WORKER_RANK=str(rank)),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(num_workers)
    ]
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
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def run_checks(script, checks, address, cwd, *, timeout):
    """Runs the checks `checks` of a worker `script` on 2 ranks against the
    server at `address`; returns {check: [(ok, rank output)]}, where ok
    says the rank printed ``ok CHECK``."""
    results = start_ranks(
        script, checks, [address], 2, cwd, timeout=timeout, jaxps_timeout=20
    )
    return {
        check: [
            (code == 0 and f"ok {check}\n" in out, out) for code, out in results
        ]
        for check in checks
    }


def assert_check_ok(results, check):
    """Fails naming every rank on which `check` of `run_checks` failed."""
    failed = [
        f"rank {rank}: {check} failed:\n{out}"
        for rank, (ok, out) in enumerate(results[check])
        if not ok
    ]
    assert not failed, "\n".join(failed)


def run_job(
    servers,
    num_workers,
    names,
    tmp_path,
    timeout=240,
    script=SCENARIOS,
    devices=4,
):
    """Runs the checks `names` of `script` on every rank (with `devices`
    forced CPU devices); asserts that each rank printed ``ok NAME`` for all
    of them."""
    results = start_ranks(
        script,
        names,
        [s.address for s in servers],
        num_workers,
        tmp_path,
        timeout=timeout,
        devices=devices,
    )
    failed = [
        f"rank {rank} (exit code {code}):\n{out}"
        for rank, (code, out) in enumerate(results)
        if code != 0 or any(f"ok {name}" not in out for name in names)
    ]
    # every rank's output: the rank that failed first may not be the one
    # whose error is reported first
    assert not failed, f"{len(failed)} rank(s) failed:\n" + "\n".join(failed)


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
def test_overlapped_gradients_equal_push_pull_of_grad(start_servers, tmp_path):
    servers = start_servers(2, 2, "--deterministic")
    run_job(
        servers,
        2,
        ["overlap", "overlap_nnx", "overlap_use_order", "overlap_shard_map"],
        tmp_path,
    )


@pytest.mark.timeout(300)
def test_async_mode_converges(start_servers, tmp_path):
    servers = start_servers(2, 2, "--async")
    run_job(servers, 2, ["async"], tmp_path)
