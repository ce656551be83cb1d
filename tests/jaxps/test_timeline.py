"""The trace written with trace_dir, and its summary."""

import jax
import jax.numpy as jnp
import pytest

import jaxps
from jaxps._src import timeline


@pytest.mark.timeout(120)
def test_trace_of_a_jitted_push_pull(start_servers, tmp_path):
    (server,) = start_servers(1, 1)
    jaxps.init(
        servers=[server.address],
        trace_dir=str(tmp_path),
        partition_bytes=4096,
    )
    try:
        step = jax.jit(
            lambda t: jaxps.push_pull(jax.tree.map(jnp.sin, t), name="tl")
        )
        tree = {"a": jnp.ones(5000), "b": jnp.ones(3)}
        for _ in range(3):
            out = step(tree)
        assert out["a"].shape == (5000,)
    finally:
        jaxps.shutdown()
    events = timeline.load(str(tmp_path / "jaxps-rank0.trace.json"))
    names = {e["name"] for e in events}
    assert {"start", "done", "in_flight", "queue", "push", "pull"} <= names
    rows = {e["tid"] for e in events if e["ph"] == "X"}
    assert f"server {server.address}" in rows and "device" in rows
    assert sum(e["name"] == "in_flight" for e in events) == 3
    summary = timeline.summarize(events)
    assert summary["comm_s"] > 0 and 0.0 <= summary["overlap"] <= 1.0
    assert summary["push_s"] > 0 and summary["pull_s"] > 0


def test_no_server_traces_and_since(tmp_path):
    import time

    jaxps.init(trace_dir=str(tmp_path))
    try:
        jax.jit(lambda t: jaxps.push_pull(t, name="solo"))(jnp.ones(3))
        later = time.time()
        time.sleep(0.01)
        jax.jit(lambda t: jaxps.push_pull(t, name="solo2"))(jnp.ones(3))
    finally:
        jaxps.shutdown()
    events = timeline.load(str(tmp_path / "jaxps-rank0.trace.json"))
    assert sum(e["name"] == "in_flight" for e in events) == 2
    assert abs(events[1]["ts"] / 1e6 - later) < 60  # wall-clock stamps
    summary = timeline.summarize(events, since=later)
    everything = timeline.summarize(events)
    assert summary["comm_s"] <= everything["comm_s"]
    assert summary["exposed_s"] <= everything["exposed_s"]
