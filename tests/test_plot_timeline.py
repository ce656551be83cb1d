"""scripts/plot_timeline.py renders a trace as a PNG."""

import pathlib
import subprocess
import sys

import pytest

from jaxps._src import timeline

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def test_renders_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    t = timeline.Timeline(str(tmp_path / "t.json"), rank=0)
    t.span("start", "device", 0.0, 0.001)
    t.span("queue", "server a:1", 0.001, 0.002, chunk="x[0]", round=0)
    t.span("push", "server a:1", 0.002, 0.010)
    t.span("pull", "server a:1", 0.010, 0.030)
    t.span("in_flight", "push_pull", 0.001, 0.030)
    t.span("done", "device", 0.020, 0.031)
    t.close()
    png = tmp_path / "t.png"
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT / "plot_timeline.py"),
            str(t.path),
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "overlap 62%" in out.stdout, out.stdout  # 1 - 11 ms / 29 ms
