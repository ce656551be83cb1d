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


@pytest.mark.parametrize(
    "address, host",
    [
        ("cpu1:9000", "cpu1"),
        ("CPU1.example:9000", "cpu1.example"),
        ("10.0.0.1:1", "10.0.0.1"),
        ("[::1]:9000", "::1"),
        ("[fe80::1%eth0]:9001", "fe80::1%eth0"),
    ],
)
def test_address_host(address, host):
    assert topology.address_host(address) == host


@pytest.mark.parametrize("bad", ["cpu1", "cpu1:", ":9000"])
def test_address_host_names_the_bad_address(bad):
    with pytest.raises(ValueError, match=f"address={bad!r}"):
        topology.address_host(bad)


def test_one_process_per_host_is_the_old_weighting():
    servers = ["a:1", "b:1", "c:1"]
    assert topology.host_weights(servers) == [1.0, 1.0, 1.0]
    coloc = ["w0:2", "w1:2", "w2:2", "w3:2"]
    assert topology.host_weights(servers, coloc) == pytest.approx(
        topology.mixed_mode_weights(4, 3)
    )


@pytest.mark.parametrize("p", [1, 2, 4])
def test_processes_of_a_host_split_its_share(p):
    servers = [f"a:{9000 + i}" for i in range(p)] + ["b:9000"]
    w = topology.host_weights(servers)
    assert w == pytest.approx([1 / p] * p + [1.0])
    # Bytes per host NIC stay balanced: each host gets half.
    sizes = [1000] * 240
    owner = topology.assign_servers(sizes, w)
    assert sum(1 for s in owner if s < p) == 120


def test_mixed_hosts_of_2_and_4_processes():
    servers = ["a:1", "b:1", "a:2", "b:2", "b:3", "b:4"]
    w = topology.host_weights(servers)
    assert w == pytest.approx([0.5, 0.25, 0.5, 0.25, 0.25, 0.25])


def test_mixed_mode_counts_hosts_not_processes():
    # 2 CPU hosts of 2 processes each and 4 colocated servers: k = 2.
    servers = ["c0:9000", "c0:9001", "c1:9000", "c1:9001"]
    coloc = [f"w{i}:9000" for i in range(4)]
    w = topology.host_weights(servers, coloc)
    ref = topology.mixed_mode_weights(4, 2)
    half = [ref[0] / 2, ref[1] / 2]
    assert w[:4] == pytest.approx([half[0], half[0], half[1], half[1]])
    assert w[4:] == pytest.approx(ref[2:])
    assert sum(w) == pytest.approx(1.0)
    assert sum(w[:4]) == pytest.approx(topology.cpu_server_share(4, 2))


def test_ipv6_brackets_group_with_the_same_host():
    servers = ["[::1]:9000", "[::1]:9001", "[fd00::2]:9000"]
    assert topology.host_groups(servers) == [[0, 1], [2]]
    assert topology.host_weights(servers) == [0.5, 0.5, 1.0]


@pytest.mark.parametrize(
    "count, weights, expected",
    [
        (25, [1, 1, 1, 1], 28),  # 7 chunks on each, not 7 on one and 6
        (24, [1, 1, 1, 1], 24),  # shared evenly already
        (3, [1, 1, 1, 1], 3),  # fewer chunks than servers: left alone
        (25, topology.mixed_mode_weights(4, 2), 30),  # 9, 9, 3, 3, 3, 3
        (25, [1, 0, 1], 26),  # a server of weight 0 takes nothing
        (1000, [1, 1, 1], 1000),  # > 64 per server: within 1/64 already
    ],
)
def test_balanced_count_shares_a_tensor_evenly(count, weights, expected):
    assert topology.balanced_count(count, weights) == expected


def test_chunk_ranges_with_weights_balance_the_busiest_server():
    elements = 25 * 250_000  # 25 MB of float32 in 1 MB partitions
    plain = topology.chunk_ranges(elements, 4, 1_000_000)
    ranges = topology.chunk_ranges(elements, 4, 1_000_000, [1, 1, 1, 1])
    assert len(plain) == 25 and len(ranges) == 28
    assert ranges[0][0] == 0 and ranges[-1][1] == elements
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    servers = topology.assign_servers(sizes, [1, 1, 1, 1])
    load = [sum(b for b, s in zip(sizes, servers) if s == i) for i in range(4)]
    assert max(load) - min(load) <= 1  # 6.25 MB each, not 7 MB on one


def test_host_index_groups_processes_of_a_cpu_host():
    servers = ["c0:9000", "c1:9000", "c0:9001", "c1:9001"]
    coloc = ["w0:9000", "w1:9000"]
    assert topology.host_index(servers, coloc) == [0, 1, 0, 1, 2, 3]


@pytest.mark.parametrize("count, expected", [(9, 10), (10, 10), (11, 12)])
def test_balanced_count_balances_hosts_not_processes(count, expected):
    # 2 hosts of 4 processes: only each host's sum loads its NIC, so 9
    # chunks become 10 (5 per host), not 16 (2 per process).
    servers = [f"c{h}:{9000 + p}" for p in range(4) for h in range(2)]
    w = topology.host_weights(servers)
    hosts = topology.host_index(servers)
    assert topology.balanced_count(count, w) == 16
    assert topology.balanced_count(count, w, hosts) == expected
