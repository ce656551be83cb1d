"""Hosts of several devices: sharded jit, nnx.jit, shard_map, at real sizes.

Two workers with 2 and with 4 forced CPU devices each, real servers, a
1024x1024 layer (4 MiB of gradient). Each check in `sharded_scenarios.py`
trains three sgd steps and compares with one process on the whole batch;
it also asserts that each device pushed only its own slice and that the
parameters kept their sharding. `errors` checks the trace-time messages of
calls that cannot place themselves (pmap or shard_map without axis_name).
"""

import pathlib

import pytest

from .test_push_pull import run_job

SCRIPT = pathlib.Path(__file__).with_name("sharded_scenarios.py")


@pytest.mark.slow  # about a minute each on 2 cores (CI runs both)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_jit_at_realistic_size(start_servers, tmp_path, devices):
    servers = start_servers(2, 2, "--round-timeout", "60")
    run_job(
        servers,
        2,
        [
            "push_pull",
            "optimizer",
            "value_and_grad",
            "shard_map",
            "linen",
            "explicit_2d",
            "nnx_2d",
            "sums_agree",
            "paths_agree",
            "pmap",
            "overlap_shard_map",
            "broadcast_and_batch_stats",
            "errors",
            "crossings",
        ],
        tmp_path,
        timeout=360,
        script=SCRIPT,
        devices=devices,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_path_bitwise_where_sums_are_exact(start_servers, tmp_path):
    """Integer data and a loss linear in the parameters: each API and path
    on 4 devices ends with the bits of one process on the whole batch."""
    servers = start_servers(2, 2, "--round-timeout", "60")
    run_job(
        servers, 2, ["bitwise"], tmp_path, timeout=240, script=SCRIPT, devices=4
    )


@pytest.mark.timeout(300)
def test_partition_measured_again_inside_sharded_steps(start_servers, tmp_path):
    """partition_bytes="auto" measures again and switches partitions while
    shard_map and a sharded jit train on 4 devices (`check_retune`; about
    15 s, so it is in the fast suite)."""
    servers = start_servers(2, 2, "--round-timeout", "60")
    run_job(
        servers, 2, ["retune"], tmp_path, timeout=240, script=SCRIPT, devices=4
    )
