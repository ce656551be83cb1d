"""Chunking, server assignment and the BytePS formula."""

import pytest

from jaxps._src import topology


@pytest.mark.parametrize("n", [1, 5, 1000, 1001, 4096 * 3 + 1])
def test_chunk_ranges_cover_exactly(n):
    ranges = topology.chunk_ranges(n, 4, 4096)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(0 < (hi - lo) * 4 <= 4096 for lo, hi in ranges)
    sizes = {hi - lo for lo, hi in ranges}
    assert max(sizes) - min(sizes) <= 1  # near-equal, no tiny tail


def test_assignment_balances_bytes_and_is_deterministic():
    sizes = [4096] * 7 + [100, 3000, 5000]
    servers = topology.assign_servers(sizes, [1, 1, 1], salt=5)
    assert servers == topology.assign_servers(sizes, [1, 1, 1], salt=5)
    load = [0, 0, 0]
    for s, b in zip(servers, sizes):
        load[s] += b
    assert max(load) - min(load) <= 5000


def test_assignment_follows_weights():
    sizes = [1000] * 300
    servers = topology.assign_servers(sizes, [2, 1, 1])
    assert servers.count(0) == 150 and servers.count(1) == 75


def test_formula_edge_cases():
    M, B = 100.0, 10.0
    n = 4
    # k = 0 is all-reduce: 2(n-1)M/(nB)
    assert topology.optimal_time(n, 0, M, B) == pytest.approx(
        2 * (n - 1) * M / (n * B)
    )
    # k = n is a plain PS: M/B
    assert topology.optimal_time(n, n, M, B) == pytest.approx(M / B)
    assert topology.cpu_server_share(n, 0) == 0
    assert topology.cpu_server_share(n, n) == pytest.approx(1.0)
    for k in range(n + 1):
        w = topology.mixed_mode_weights(n, k)
        assert sum(w) == pytest.approx(1.0)
        assert sum(w[:k]) == pytest.approx(topology.cpu_server_share(n, k))
