"""Prometheus metrics and the console status line of a server."""

import socket
import urllib.request

import numpy as np
import pytest

from jaxps._src.config import Config
from jaxps._src.runtime import Runtime


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_metrics_endpoint_and_status_line(start_servers):
    port = free_port()
    (server,) = start_servers(
        1, 1, "--metrics-port", str(port), "--status-interval", "0.2"
    )
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape():
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("jaxps_")
        }

    rt = Runtime(Config(servers=(server.address,)))
    try:
        for _ in range(3):
            rt.push_pull("m", np.ones(1000, np.float32))
        values = scrape()
    finally:
        rt.close()
    assert values["jaxps_rounds_completed_total"] == 3
    assert values["jaxps_bytes_summed_total"] == 3 * 4000
    assert values["jaxps_live_rounds"] == 0
    assert values["jaxps_keys"] == 1
    assert values['jaxps_worker_lag_rounds{rank="0"}'] == 0
    # The job said Bye: its key is freed, the counters stay.
    values = scrape()
    assert values["jaxps_keys"] == 0
    assert values["jaxps_rounds_completed_total"] == 3
    line = server.proc.stdout.readline()
    assert line.startswith(f"jaxps-server {server.address}: "), line
    assert "rounds" in line and "GB summed" in line
