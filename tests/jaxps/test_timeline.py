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


def _span(name, start_ms, end_ms, tid="device"):
    return {
        "name": name,
        "ph": "X",
        "pid": 0,
        "tid": tid,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
    }


def test_summarize_counts_overlapping_spans_once():
    # three per-leaf push_pulls of one step, started during the backward
    # pass, and their done callbacks, two of which wait at the same time
    events = [
        _span("in_flight", 0, 10, "push_pull"),
        _span("in_flight", 4, 12, "push_pull"),
        _span("in_flight", 20, 25, "push_pull"),
        _span("done", 8, 11),
        _span("done", 9, 12),
        _span("done", 22, 25),
        _span("done", 30, 31, "other row"),
    ]
    summary = timeline.summarize(events)
    assert summary["comm_s"] == pytest.approx(0.017)  # 0-12 and 20-25
    assert summary["in_flight_sum_s"] == pytest.approx(0.023)
    assert summary["exposed_s"] == pytest.approx(0.007)  # 8-12 and 22-25
    assert summary["done_sum_s"] == pytest.approx(0.009)
    assert summary["overlap"] == pytest.approx(1 - 7 / 17)
    assert (summary["push_pulls"], summary["dones"]) == (3, 3)
    # `until` drops spans starting at or after it (seconds, like `since`)
    early = timeline.summarize(events, since=0.0, until=0.015)
    assert early["comm_s"] == pytest.approx(0.012)
    assert early["exposed_s"] == pytest.approx(0.004)
    assert timeline.union_seconds([]) == 0.0


def test_summarize_of_disjoint_spans_is_their_sum():
    events = [
        _span("in_flight", 0, 3, "push_pull"),
        _span("in_flight", 5, 9, "push_pull"),
        _span("done", 2, 3),
        _span("done", 8, 9),
    ]
    summary = timeline.summarize(events)
    assert summary["comm_s"] == pytest.approx(summary["in_flight_sum_s"])
    assert summary["exposed_s"] == pytest.approx(summary["done_sum_s"])
