"""The wire plan of one push_pull: which pieces go to which server.

Large tensors are cut into chunks of at most `partition_bytes`; tensors that
fit in a chunk are packed, per dtype and in order, into fused pieces of at
most `partition_bytes`, so a model with many small tensors costs few calls.
The plan depends only on the names, sizes and dtypes, so every worker makes
the same one.
"""

from __future__ import annotations

import dataclasses
import hashlib

from jaxps._src import topology
from jaxps.servers import _wire


@dataclasses.dataclass(frozen=True)
class Piece:
    """One message's worth of a push_pull.

    Attributes:
      wire_name: the name whose round counter numbers this piece's rounds.
      key: the server key.
      label: a readable name, for messages.
      server: index of the server it goes to.
      members: ``(tensor index, start, stop)`` element ranges, concatenated
        in this order to form the payload.
      length: number of elements.
      priority: higher goes out first.
    """

    wire_name: str
    key: int
    label: str
    server: int
    members: tuple[tuple[int, int, int], ...]
    length: int
    priority: int

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


def make_plan(
    names: list[str],
    sizes: list[int],
    dtypes: list[str],
    itemsizes: list[int],
    priorities: list[int],
    *,
    partition_bytes: int,
    weights: list[float],
) -> list[Piece]:
    """Cuts, fuses and assigns the tensors of one push_pull."""
    drafts = []  # (wire_name, label, chunk index, members, length, priority)
    buckets: dict[str, list] = {}  # dtype -> members of the open bucket
    order: list[tuple[str, list]] = []

    for t, (name, size, itemsize) in enumerate(zip(names, sizes, itemsizes)):
        if size * itemsize > partition_bytes:
            ranges = topology.chunk_ranges(size, itemsize, partition_bytes)
            for c, (lo, hi) in enumerate(ranges):
                drafts.append(
                    (
                        name,
                        f"{name}[{c}]",
                        c,
                        ((t, lo, hi),),
                        hi - lo,
                        priorities[t],
                    )
                )
            continue
        bucket = buckets.get(dtypes[t])
        used = sum(hi - lo for _, lo, hi in bucket) * itemsize if bucket else 0
        if bucket is None or used + size * itemsize > partition_bytes:
            bucket = []
            buckets[dtypes[t]] = bucket
            order.append((dtypes[t], bucket))
        bucket.append((t, 0, size))

    for _, members in order:
        length = sum(hi - lo for _, lo, hi in members)
        priority = max(priorities[t] for t, _, _ in members)
        if len(members) == 1:
            t = members[0][0]
            drafts.append(
                (
                    names[t],
                    f"{names[t]}[0]",
                    0,
                    tuple(members),
                    length,
                    priority,
                )
            )
            continue
        member_names = [names[t] for t, _, _ in members]
        digest = hashlib.blake2b(
            "\0".join(member_names).encode(), digest_size=8
        ).hexdigest()
        wire = f"fused:{digest}"
        label = f"fused({member_names[0]}, ... {len(members)} tensors)"
        drafts.append((wire, label, 0, tuple(members), length, priority))

    item = {t: itemsizes[t] for t in range(len(names))}
    nbytes = [d[4] * item[d[3][0][0]] for d in drafts]
    salt = topology.tensor_id(names[0]) if names else 0
    servers = topology.assign_servers(nbytes, weights, salt=salt)
    return [
        Piece(
            wire_name=wire,
            key=_wire.make_key(topology.tensor_id(wire), chunk),
            label=label,
            server=server,
            members=members,
            length=length,
            priority=priority,
        )
        for (wire, label, chunk, members, length, priority), server in zip(
            drafts, servers
        )
    ]
