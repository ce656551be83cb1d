"""The device-path benchmarks run end to end in their quick forms (CI).

``benchmarks/op.py`` times a jitted push_pull for 1 MiB, twice;
``benchmarks/leaves.py`` 1 and 20 leaves, jitted and in the runtime alone.

``benchmarks/gpu.py --quick`` runs on the CPU here (on a GPU host it runs
there); ``benchmarks/multidevice.py`` on 2 forced devices and one width.
Each must exit 0 and print every row of its tables.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *flags: str, timeout: float = 280) -> str:
    # as a user would run it: no JAXPS_* of the tests, no forced devices
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXPS_") and k != "XLA_FLAGS"
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_bench_quick_on_cpu():
    out = _run("gpu.py", "--quick")
    assert "device: cpu" in out, out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith(("plain", "jaxps")):
            rows.setdefault(cells[0], []).append(cells)
    assert sorted(rows) == [
        "jaxps, 1 worker(s)",
        "jaxps, 2 worker(s)",
        "plain",
    ], out
    assert len(rows["jaxps, 2 worker(s)"]) == 2, out  # one row per rank
    for label, found in rows.items():
        for _, ms, ratio, callbacks, leaves, _ in found:
            assert float(ms) > 0 and ratio.endswith("x"), out
            assert leaves == "8", out
            # starts of value_and_grad's buckets and one done, per step
            assert int(callbacks) >= (2 if label != "plain" else 0), out
    for route in ("jaxps callback", "device_get", "pinned_host put"):
        assert re.search(rf"\|\s*4 MiB\s*\|\s*{route}\s*\|", out), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multidevice_bench_runs_every_path():
    out = _run(
        "multidevice.py", "--devices", "2", "--widths", "512", "--steps", "2"
    )
    for path in ("local", "sharded jit", "shard_map", "jax gloo"):
        row = rf"\|\s*2\s*\|\s*512\s*\|\s*{path}\s*\|\s*[\d.]+\s*\|"
        assert re.search(row, out), out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_op_bench_runs():
    out = _run("op.py", "--sizes-mb", "1", "--repeats", "2", timeout=180)
    assert re.search(r"\|\s*1\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|", out), out


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("host", [False, True], ids=["jit", "host"])
def test_leaves_bench_runs(host):
    # through a jitted push_pull, and with --host the runtime alone
    flags = ["--leaves", "1,20", "--sizes-kib", "64", "--repeats", "3"]
    out = _run("leaves.py", *flags, *(["--host"] if host else []), timeout=180)
    for leaves in ("1", "20"):
        row = rf"\|\s*64\s*\|\s*{leaves}\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|"
        assert re.search(row, out), out
