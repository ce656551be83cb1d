"""Server metrics: a Prometheus endpoint and a one-line console status."""

from __future__ import annotations

import time
from typing import Protocol


class Counters(Protocol):
    """What the metrics read: `_jobs.Jobs` (summed over sessions) or one
    store."""

    bytes_summed: int
    rounds_completed: int
    last_round_by_rank: dict[int, int]
    num_keys: int

    def pending_pulls(self) -> int: ...

    def pending_rounds(self) -> int: ...


def snapshot(store: Counters) -> dict:
    """The counters and gauges of `store`, read now."""
    last = dict(store.last_round_by_rank)
    newest = max(last.values(), default=0)
    return {
        "bytes_summed": store.bytes_summed,
        "rounds_completed": store.rounds_completed,
        "live_rounds": store.pending_rounds(),
        "pending_pulls": store.pending_pulls(),
        "keys": store.num_keys,
        "lag": {rank: newest - r for rank, r in sorted(last.items())},
    }


def start_prometheus(store: Counters, host: str, port: int):
    """Serves the store's metrics at http://host:port/metrics."""
    try:
        import prometheus_client
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )
    except ImportError:
        raise OSError(
            "--metrics-port needs prometheus-client: pip install "
            '"jaxps[metrics]"'
        ) from None

    class Collector:
        def collect(self):
            s = snapshot(store)
            yield CounterMetricFamily(
                "jaxps_bytes_summed", "Payload bytes summed.", s["bytes_summed"]
            )
            yield CounterMetricFamily(
                "jaxps_rounds_completed",
                "Rounds whose sum is complete.",
                s["rounds_completed"],
            )
            yield GaugeMetricFamily(
                "jaxps_live_rounds",
                "Rounds not yet pulled by every worker.",
                s["live_rounds"],
            )
            yield GaugeMetricFamily(
                "jaxps_pending_pulls",
                "Pulls waiting for a round to complete.",
                s["pending_pulls"],
            )
            yield GaugeMetricFamily("jaxps_keys", "Known keys.", s["keys"])
            lag = GaugeMetricFamily(
                "jaxps_worker_lag_rounds",
                "Rounds a worker's latest push is behind the newest.",
                labels=["rank"],
            )
            for rank, behind in s["lag"].items():
                lag.add_metric([str(rank)], behind)
            yield lag

    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector())
    server, _ = prometheus_client.start_http_server(
        port, addr=host, registry=registry
    )
    return server


class StatusLine:
    """Formats a one-line status of a server from successive snapshots."""

    def __init__(self, address: str):
        self.address = address
        self._last = (time.monotonic(), 0)

    def line(self, store: Counters) -> str:
        s = snapshot(store)
        now = time.monotonic()
        then, summed = self._last
        rate = (s["bytes_summed"] - summed) / max(now - then, 1e-9)
        self._last = (now, s["bytes_summed"])
        lag = " ".join(f"r{k}+{v}" for k, v in s["lag"].items() if v) or "0"
        return (
            f"jaxps-server {self.address}: {s['rounds_completed']} rounds, "
            f"{s['bytes_summed'] / 1e9:.2f} GB summed ({rate / 1e6:.1f} MB/s), "
            f"{s['live_rounds']} live rounds, {s['pending_pulls']} pending "
            f"pulls, {s['keys']} keys, lag {lag}"
        )
