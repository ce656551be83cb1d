"""End-to-end run of the emulated-cluster benchmark in its --quick form.

    python -m pytest tests/test_cluster_bench.py -m slow

Needs root and ``ip netns``; skipped otherwise. The benchmark builds network
namespaces named ``jxb-<pid>-*`` and must delete all of them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cluster.py"


def _netns_module():
    spec = importlib.util.spec_from_file_location(
        "cluster_bench_netns", ROOT / "benchmarks" / "_netns.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _quick_run(*flags: str, timeout: float = 270) -> str:
    """Runs ``cluster.py --quick *flags``; returns its stdout."""
    return _bench_run(SCRIPT, "--quick", *flags, timeout=timeout)


def _bench_run(script: Path, *flags: str, timeout: float) -> str:
    """Runs the namespace benchmark `script` with `flags`; returns its
    stdout.

    Skips without root or iproute2; fails unless it exits 0 and leaves no
    namespace behind.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2 (ip, tc)")
    try:
        subprocess.run(
            ["ip", "netns", "list"], check=True, capture_output=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"`ip netns` is unavailable: {err}")

    # As a user would run it: no JAXPS_* of the test process, no fake
    # devices from conftest's XLA_FLAGS.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXPS_") and k != "XLA_FLAGS"
    }
    proc = subprocess.Popen(
        [sys.executable, str(script), *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    own = f"jxb-{proc.pid}-"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the benchmark delete its namespaces; then make sure.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
        _netns_module().cleanup(own)
        pytest.fail(f"{script.name} {flags} took more than {timeout} s")

    # Only its own: another run of the benchmark may be going on.
    left = {ns for ns in _namespaces() if ns.startswith(own)}
    if left:
        _netns_module().cleanup(own)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert not left, f"namespaces left behind: {sorted(left)}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cluster_quick_run_prints_table_and_cleans_up():
    # One run covers both: the table and goals, and 2 processes per CPU
    # server host. Of the smallest mixed config, 2 workers and 1 CPU server
    # host: the suite's time is bounded, and this run costs ~18 s (the
    # quick default, (4,2), ~40 s).
    out = _quick_run("--server-processes", "2", "--configs", "2,1")
    assert "| config (n,k) |" in out, out
    assert "jaxps/t_opt" in out and "goals:" in out, out
    assert "2 process(es) per CPU server" in out, out
    (row,) = [line for line in out.splitlines() if line.startswith("| (2,1)")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    topt, bound = float(cells[2]), float(cells[4])
    # The plan counts the 2 processes of a host as one server of t_opt.
    assert bound <= topt * 1.1, row
    assert cells[7] != "-", row  # the plain PS ran too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_retune_bench_measures_again_when_the_links_change():
    """benchmarks/retune.py, small: (2,1), 3 MB calls (timed: 4 partitions
    or more), the links go from 400 to 50 Mbit/s after 8 calls, epochs of
    4 calls. The defaults' job measures again (at call 16, where the window
    of calls 10-13 is all at 50 Mbit/s) and takes a smaller partition; the
    job that measured once keeps its own."""
    out = _bench_run(
        ROOT / "benchmarks" / "retune.py",
        *("--changes", "400,50", "--n", "2", "--k", "1", "--mb", "3"),
        *("--before", "8", "--after", "20", "--retune-calls", "4"),
        *("--steady", "4"),
        timeout=270,
    )
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| 400 -> 50 |") and cells[1] in (
            "retune",
            "once",
            "tuned",
        ):
            rows[cells[1]] = cells
    assert set(rows) == {"retune", "once", "tuned"}, out
    before, after = map(int, rows["retune"][2].split(" -> "))
    assert int(rows["retune"][3].split()[0]) >= 1, rows["retune"]
    assert after < before, rows["retune"]
    assert int(rows["once"][3].split()[0]) == 0, rows["once"]
    once_before, once_after = map(int, rows["once"][2].split(" -> "))
    assert once_before == once_after, rows["once"]


def _cluster_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "cluster_bench_main", SCRIPT
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.mark.parametrize("n, k", [(4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("processes", [1, 2, 4])
def test_plan_bound_counts_a_host_once_whatever_its_processes(n, k, processes):
    from jaxps._src import topology

    bench = _cluster_module()
    m, partition = 25_000_000, 96 * 1024
    bound = bench.plan_link_bytes(n, k, m, partition, True, processes)
    topt = topology.optimal_time(n, k, m, 1.0)  # in bytes on a link
    assert topt <= bound <= topt * 1.01
    # Plain PS: every CPU host link carries n M / k, split over its processes.
    plain = bench.plan_link_bytes(n, k, m, partition, False, processes)
    assert n * m / k <= plain <= n * m / k * 1.01
