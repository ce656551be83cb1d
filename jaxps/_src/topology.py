"""Chunking, key-to-server assignment and the BytePS traffic formula.

Every function here is deterministic, so every worker computes the same keys
and the same server for each key without talking to the others.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

from jaxps.servers import _wire


def tensor_id(name: str) -> int:
    """A 48-bit id of a tensor name, the same on every worker."""
    digest = hashlib.blake2b(name.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


def chunk_ranges(
    num_elements: int,
    itemsize: int,
    partition_bytes: int,
    weights: Sequence[float] = (),
    hosts: Sequence[int] = (),
) -> list[tuple[int, int]]:
    """Splits ``num_elements`` into near-equal ranges of <= partition_bytes.

    With server `weights` (and the `hosts` they run on), a tensor of at
    least one chunk per server is cut into the count, at most one more per
    server, that those hosts share best (see `balanced_count`).
    """
    per_chunk = max(1, partition_bytes // itemsize)
    count = max(1, -(-num_elements // per_chunk))
    if weights:
        count = min(balanced_count(count, weights, hosts), max(num_elements, 1))
    if count > _wire.MAX_CHUNKS:
        raise ValueError(
            f"a tensor of {num_elements} elements needs {count} chunks of "
            f"{partition_bytes} bytes, more than {_wire.MAX_CHUNKS}; increase "
            "partition_bytes."
        )
    base, extra = divmod(num_elements, count)
    ranges, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


#: Tensors of more chunks per server than this are not rebalanced: their
#: chunks are shared within 1/64 of the best already.
_BALANCE_LIMIT = 64


def balanced_count(
    count: int, weights: Sequence[float], hosts: Sequence[int] = ()
) -> int:
    """The number of equal chunks, from `count` to `count` + one per server,
    whose busiest host (its load / its weight) is least loaded.

    25 chunks on 4 equal servers put 7 on one (12% above the mean, and that
    server's link sets the step time); 28 chunks, 11% smaller, put 7 on each.
    `hosts` gives the host of each server (default: one each): the processes
    of one host share its NIC, so only their sum counts. A tensor of fewer
    chunks than servers, or of more than `_BALANCE_LIMIT` per server, keeps
    `count`.
    """
    live = [s for s, w in enumerate(weights) if w > 0]
    if not live or count < len(live) or count > _BALANCE_LIMIT * len(live):
        return count
    host_of = [hosts[s] if hosts else s for s in live]
    total = sum(weights[s] for s in live)
    best, best_cost = count, float("inf")
    for m in range(count, count + len(live) + 1):
        cost = _busiest(m, [weights[s] for s in live], host_of) * total / m
        if cost < best_cost - 1e-9:  # 1.0: perfectly balanced
            best, best_cost = m, cost
    return best


def _busiest(count: int, weights: list[float], hosts: list[int]) -> float:
    """The largest host load / host weight after `assign_servers` places
    `count` equal chunks (each goes where its load / weight after taking it
    is least)."""
    heap = [(1 / w, s) for s, w in enumerate(weights)]
    load = [0] * len(weights)
    for _ in range(count):
        _, s = heapq.heappop(heap)
        load[s] += 1
        heapq.heappush(heap, ((load[s] + 1) / weights[s], s))
    host_load: dict[int, float] = {}
    host_weight: dict[int, float] = {}
    for s, h in enumerate(hosts):
        host_load[h] = host_load.get(h, 0) + load[s]
        host_weight[h] = host_weight.get(h, 0) + weights[s]
    return max(host_load[h] / host_weight[h] for h in host_load)


def assign_servers(
    sizes: Sequence[int],
    weights: Sequence[float],
    salt: int = 0,
) -> list[int]:
    """Assigns chunks to servers, balancing bytes in proportion to weights.

    Largest chunks go first, each to the server whose weighted load after
    taking it is smallest (ties go to the server after ``salt`` in order).

    Args:
      sizes: bytes of each chunk.
      weights: the share of traffic each server should take (any scale).
      salt: rotates tie-breaking so that small groups spread over servers.

    Returns:
      The server index of each chunk.
    """
    num = len(weights)
    if num == 0:
        raise ValueError("assign_servers needs at least one server.")
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"server weights must be >= 0, some > 0: {weights}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    load = [0.0] * num
    tie = [(s - salt) % num for s in range(num)]
    live = [s for s in range(num) if weights[s] > 0]
    out = [0] * len(sizes)
    for i in order:
        best = min(
            live, key=lambda s: ((load[s] + sizes[i]) / weights[s], tie[s])
        )
        load[best] += sizes[i]
        out[i] = best
    return out


def cpu_server_share(n: int, k: int) -> float:
    """Fraction of all traffic that BytePS sends to the k CPU servers.

    With n workers and k CPU-only servers it is 2k(n-1)/(n^2+kn-2k); the rest
    goes to the n servers colocated on the workers ("mixed mode").
    """
    _check_nk(n, k)
    return 2 * k * (n - 1) / (n * n + k * n - 2 * k)


def mixed_mode_weights(n: int, k: int) -> list[float]:
    """Per-server traffic weights: k CPU servers first, then n colocated.

    Each CPU server takes 2(n-1)/(n^2+kn-2k) of the model and each colocated
    server (n-k)/(n^2+kn-2k) (Theorem 1 of the BytePS paper).
    """
    _check_nk(n, k)
    denom = n * n + k * n - 2 * k
    return [2 * (n - 1) / denom] * k + [(n - k) / denom] * n


def optimal_time(n: int, k: int, model_bytes: float, bandwidth: float) -> float:
    """t_opt = 2n(n-1)M / ((n^2+kn-2k) B), in the units of M / B."""
    _check_nk(n, k)
    return 2 * n * (n - 1) * model_bytes / ((n * n + k * n - 2 * k) * bandwidth)


def _check_nk(n: int, k: int) -> None:
    if n < 1 or k < 0:
        raise ValueError(
            f"need n >= 1 workers and k >= 0 servers, got n={n}, k={k}."
        )


def address_host(address: str) -> str:
    """The host of a ``HOST:PORT`` or ``[IPV6]:PORT`` address, lowercased.

    Raises:
      ValueError: `address` has no ``:PORT``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"expected HOST:PORT, got address={address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower()


def host_groups(addresses: Sequence[str]) -> list[list[int]]:
    """Indices of `addresses` grouped by host, in order of first use."""
    groups: dict[str, list[int]] = {}
    for i, address in enumerate(addresses):
        groups.setdefault(address_host(address), []).append(i)
    return list(groups.values())


def host_weights(
    servers: Sequence[str], colocated: Sequence[str] = ()
) -> list[float]:
    """Per-process traffic weights of `servers`, then of `colocated`.

    The bytes are balanced per host NIC: all server processes on one host
    are one server of the BytePS formula, whose share is split equally
    among them. With k distinct CPU-server hosts and n colocated servers
    (one per worker host) the hosts take `mixed_mode_weights` (n, k);
    without colocated servers every CPU-server host takes weight 1.
    """
    groups = host_groups(servers)
    if colocated:
        host_share = mixed_mode_weights(len(colocated), len(groups))
        coloc = host_share[len(groups) :]
    else:
        host_share, coloc = [1.0] * len(groups), []
    weights = [0.0] * len(servers)
    for share, group in zip(host_share, groups):
        for i in group:
            weights[i] = share / len(group)
    return weights + list(coloc)


def host_index(
    servers: Sequence[str], colocated: Sequence[str] = ()
) -> list[int]:
    """The host of each of `servers`, then of `colocated`, as
    `host_weights` counts them: CPU server processes on one host share an
    index; each colocated server has its own."""
    index = [0] * len(servers)
    groups = host_groups(servers)
    for h, group in enumerate(groups):
        for i in group:
            index[i] = h
    return index + [len(groups) + i for i in range(len(colocated))]
