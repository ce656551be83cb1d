"""End-to-end runs of the examples: 2 workers and 2 servers via jaxps-launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(
    script: str, *args: str, launch_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Runs ``examples/<script> ARGS`` on 2 workers and 2 servers."""
    # The examples run as a user would: no JAXPS_* settings of the test
    # process and no fake devices from conftest's XLA_FLAGS.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXPS_") and k != "XLA_FLAGS"
    }
    argv = [
        sys.executable,
        "-m",
        "jaxps._src.launch",
        "--workers",
        "2",
        "--servers",
        "2",
        *launch_flags,
        "--",
        sys.executable,
        f"examples/{script}",
        *args,
    ]
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def _per_worker(pattern: str, stdout: str) -> dict[int, str]:
    """``{rank: group 1}`` of the ``[worker rank] <pattern>`` lines."""
    found = re.findall(rf"^\[worker (\d+)\] {pattern}$", stdout, re.M)
    return {int(rank): value for rank, value in found}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mnist_two_workers_reach_accuracy():
    proc = _launch("mnist.py", "--epochs", "8", "--min-accuracy", "0.95")
    sums = _per_worker(r"params checksum after broadcast: (\w+)", proc.stdout)
    assert sorted(sums) == [0, 1], proc.stdout
    assert sums[0] == sums[1], proc.stdout
    accuracy = _per_worker(r"test accuracy: ([\d.]+)", proc.stdout)
    assert sorted(accuracy) == [0, 1], proc.stdout
    # Synchronized training: both workers end with the same model.
    assert accuracy[0] == accuracy[1], proc.stdout
    assert float(accuracy[0]) >= 0.95, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mnist_async_mode_converges():
    proc = _launch(
        "mnist.py", "--epochs", "8", "--async", launch_flags=("--async",)
    )
    accuracy = _per_worker(r"test accuracy: ([\d.]+)", proc.stdout)
    assert sorted(accuracy) == [0, 1], proc.stdout
    # no barrier: the workers end with slightly different models
    assert min(float(a) for a in accuracy.values()) >= 0.9, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_benchmark_two_workers(model):
    proc = _launch(
        "benchmark.py",
        "--model",
        model,
        "--batch-size",
        "4",
        "--num-warmup-batches",
        "1",
        "--num-batches-per-iter",
        "2",
        "--num-iters",
        "2",
    )
    iters = re.findall(
        r"^\[worker (\d+)\] Iter #(\d+): [\d.]+ samples/sec "
        r"per worker$",
        proc.stdout,
        re.M,
    )
    assert iters == [("0", "0"), ("0", "1")], proc.stdout  # rank 0 only
    per_worker = _per_worker(
        r"Samples/sec per worker: ([\d.]+) \+-[\d.]+", proc.stdout
    )
    total = _per_worker(
        r"Total samples/sec on 2 worker\(s\): ([\d.]+) \+-[\d.]+", proc.stdout
    )
    assert list(per_worker) == [0] and list(total) == [0], proc.stdout
    assert float(per_worker[0]) > 0
    assert float(total[0]) == pytest.approx(2 * float(per_worker[0]), abs=0.2)
    # the workers' batches differ, so do their BatchNorm statistics, until
    # jaxps.sync_batch_stats averages them
    stats = _per_worker(r"batch stats checksum: (\w+ -> \w+)", proc.stdout)
    if model == "resnet":
        assert sorted(stats) == [0, 1], proc.stdout
        (before0, after0), (before1, after1) = (
            stats[r].split(" -> ") for r in (0, 1)
        )
        assert before0 != before1 and after0 == after1, proc.stdout
    else:
        assert stats == {}, proc.stdout
