"""The wire plan of one push_pull: which pieces go to which server.

Large tensors are cut into equal chunks of at most `partition_bytes`, as
many as the servers share evenly (`topology.balanced_count`); tensors that
fit in a chunk are packed, per dtype and in order, into fused pieces of at
most `partition_bytes`, so a model with many small tensors costs few calls.
The plan depends only on the names, sizes and dtypes, so every worker makes
the same one. `buffers` then lays a push_pull's arrays out along the plan:
what each piece pushes and where its sum lands.

`call_check` describes the one-element piece that lets the servers tell at
once when ranks push different trees under one name (see `call_name`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sys
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jaxps._src import topology
from jaxps.servers import _wire


class Member(NamedTuple):
    """The elements ``[start, stop)`` of tensor `tensor` (its index)."""

    tensor: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Piece:
    """One message's worth of a push_pull.

    Attributes:
      wire_name: the name whose round counter numbers this piece's rounds.
      key: the server key.
      label: a readable name, for messages.
      server: index of the server it goes to.
      members: element ranges, concatenated in this order to form the
        payload.
      length: number of elements.
      priority: higher goes out first.
    """

    wire_name: str
    key: int
    label: str
    server: int
    members: tuple[Member, ...]
    length: int
    priority: int

    @property
    def fused(self) -> bool:
        """Whether it is of several tensors (each of them whole)."""
        return len(self.members) > 1

    @functools.cached_property
    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """Per member, (tensor, start, stop) of its elements in the
        payload."""
        found, offset = [], 0
        for m in self.members:
            found.append((m.tensor, offset, offset + m.size))
            offset += m.size
        return tuple(found)


class _Draft(NamedTuple):
    """A piece before it has a key and a server."""

    wire_name: str
    label: str
    chunk: int
    members: tuple[Member, ...]
    length: int
    priority: int


class Gather:
    """The payload of a fused piece, left in its members' arrays.

    Joining the members into one array costs a pass over every byte (16 MiB
    of 82 KiB tensors: about 4 ms on a 2-core host, a tenth of the call).
    The data channel sends the parts with one ``sendmsg`` and shared memory
    copies them straight into the slot; only what needs one array (gRPC
    messages, a kept copy for a re-push) joins them, once (`joined`).

    Attributes:
      parts: flat arrays of one dtype, in payload order (read-only).
      dtype: their dtype.
      size: elements in all.
      nbytes: bytes in all.
    """

    __slots__ = ("parts", "dtype", "size", "nbytes", "_joined")

    def __init__(self, parts: Sequence[np.ndarray], size: int | None = None):
        self.parts = tuple(parts)
        self.dtype = self.parts[0].dtype
        self.size = sum(p.size for p in self.parts) if size is None else size
        self.nbytes = self.size * self.dtype.itemsize
        self._joined: np.ndarray | None = None

    def joined(self) -> np.ndarray:
        """The payload as one new array (made once)."""
        if self._joined is None:
            self._joined = np.concatenate(self.parts)
        return self._joined

    def copy_into(self, out: np.ndarray) -> None:
        """Writes the payload into the flat array `out` (of `size`)."""
        np.concatenate(self.parts, out=out)


def payload(source: np.ndarray | Gather) -> np.ndarray:
    """A piece's payload as one flat array (a `Gather` joined)."""
    return source.joined() if isinstance(source, Gather) else source


def copy_payload(source: np.ndarray | Gather, out: np.ndarray) -> None:
    """Writes a piece's payload into the flat array `out` (one copy, also
    of a `Gather`)."""
    if isinstance(source, Gather):
        source.copy_into(out)
    else:
        np.copyto(out, source.reshape(-1))


class Buffers(NamedTuple):
    """The arrays of one piece: its payload and where its sum goes."""

    source: np.ndarray | Gather
    dest: np.ndarray


def make_plan(
    names: list[str],
    sizes: list[int],
    dtypes: list[str],
    itemsizes: list[int],
    priorities: list[int],
    *,
    partition_bytes: int,
    weights: list[float],
    hosts: list[int] | tuple[int, ...] = (),
    salt: int | None = None,
) -> list[Piece]:
    """Cuts, fuses and assigns the tensors of one push_pull.

    `hosts` is the host of each server (`topology.host_index`); without it
    every server is its own host. `salt` breaks ties of the assignment
    (`topology.assign_servers`; default: from the first name): with the
    `topology.tensor_id` of the call's name, a call of one piece goes to
    the server of its call check (`CallCheck.server`), which the piece
    then carries.
    """
    drafts: list[_Draft] = []
    buckets: dict[str, list[Member]] = {}  # dtype -> the open bucket
    order: list[list[Member]] = []

    for t, (name, size, itemsize) in enumerate(zip(names, sizes, itemsizes)):
        if size * itemsize > partition_bytes:
            ranges = topology.chunk_ranges(
                size, itemsize, partition_bytes, weights, hosts
            )
            for c, (lo, hi) in enumerate(ranges):
                drafts.append(
                    _Draft(
                        wire_name=name,
                        label=f"{name}[{c}]",
                        chunk=c,
                        members=(Member(t, lo, hi),),
                        length=hi - lo,
                        priority=priorities[t],
                    )
                )
            continue
        bucket = buckets.get(dtypes[t])
        used = sum(m.size for m in bucket) * itemsize if bucket else 0
        if bucket is None or used + size * itemsize > partition_bytes:
            bucket = []
            buckets[dtypes[t]] = bucket
            order.append(bucket)
        bucket.append(Member(t, 0, size))

    for members in order:
        drafts.append(_fuse(names, members, priorities))

    nbytes = [d.length * itemsizes[d.members[0].tensor] for d in drafts]
    if salt is None:
        salt = topology.tensor_id(names[0]) if names else 0
    servers = topology.assign_servers(nbytes, weights, salt=salt)
    return [
        Piece(
            wire_name=d.wire_name,
            key=_wire.make_key(topology.tensor_id(d.wire_name), d.chunk),
            label=d.label,
            server=server,
            members=d.members,
            length=d.length,
            priority=d.priority,
        )
        for d, server in zip(drafts, servers)
    ]


def _fuse(names, members: list[Member], priorities) -> _Draft:
    """The draft of one bucket; a lone tensor keeps its own name."""
    length = sum(m.size for m in members)
    priority = max(priorities[m.tensor] for m in members)
    if len(members) == 1:
        name = names[members[0].tensor]
        return _Draft(name, f"{name}[0]", 0, tuple(members), length, priority)
    member_names = [names[m.tensor] for m in members]
    digest = hashlib.blake2b(
        "\0".join(member_names).encode(), digest_size=8
    ).hexdigest()
    label = f"fused({member_names[0]}, ... {len(members)} tensors)"
    return _Draft(f"fused:{digest}", label, 0, tuple(members), length, priority)


#: Outputs of at least this many bytes are reused once no one else holds
#: them: glibc maps arrays above 32 MiB afresh, and the kernel zeroes
#: every page of each new one (17% of a worker's CPU at 64 MiB calls).
REUSE_BYTES = 32 << 20


class Outputs:
    """Flat outputs of push_pulls, the large ones reused (one per runtime).

    The last two made are kept per size and dtype. One is reused only when
    nothing but this pool refers to it: the caller's results and every
    view of them (the transports write the sums through views) hold a
    reference.
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._pools: dict[tuple[int, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def like(self, flat: np.ndarray) -> np.ndarray:
        """A new output of `flat`'s size and dtype, or a large one reused."""
        if flat.nbytes < REUSE_BYTES:
            return np.empty_like(flat)
        with self._lock:
            pool = self._pools.setdefault((flat.size, flat.dtype.str), [])
            for i in range(len(pool)):
                # the pool's reference and getrefcount's own
                if sys.getrefcount(pool[i]) == 2:
                    return pool[i]
            out = np.empty_like(flat)
            pool.append(out)
            del pool[: -self._keep]  # those still held are the caller's
            return out

    def pooled(self, out: np.ndarray) -> bool:
        """Whether `out` (or the array it is a view of) is in the pool."""
        base = out if out.base is None else out.base
        with self._lock:
            return any(base is p for pool in self._pools.values() for p in pool)


def buffers(
    pieces: Sequence[Piece],
    flats: Sequence[np.ndarray],
    outputs: Outputs | None = None,
) -> tuple[list[Buffers], list[np.ndarray]]:
    """Lays out the flat arrays of a push_pull along its plan.

    A fused piece's payload is a `Gather` of its members' flat arrays (no
    copy); its dest is a new array, and the output of each member is a
    view of it. A piece of one tensor pushes a view of the tensor's flat
    array and its dest is a view of the tensor's output, a new array of
    its size (or a large one of `outputs` that no one holds any more).

    Returns:
      The buffers of each piece, in plan order, and the flat output of
      each tensor (complete once every piece's sum is in its dest).
    """
    outs: list = [None] * len(flats)
    laid_out = []
    for piece in pieces:
        if piece.fused:  # of whole tensors
            spans = piece.spans
            dest = np.empty(piece.length, flats[spans[0][0]].dtype)
            for t, lo, hi in spans:
                outs[t] = dest[lo:hi]  # a view
            gather = Gather([flats[t] for t, _, _ in spans], piece.length)
            laid_out.append(Buffers(gather, dest))
        else:
            ((t, lo, hi),) = piece.members
            if outs[t] is None:
                outs[t] = (
                    np.empty_like(flats[t])
                    if outputs is None
                    else outputs.like(flats[t])
                )
            laid_out.append(Buffers(flats[t][lo:hi], outs[t][lo:hi]))
    return laid_out, outs


# -- the call check -----------------------------------------------------------

#: Longest description of a call's tree in a call check (its signature
#: covers all of it).
MAX_DESCRIPTION = 1024

_SHARD = re.compile(r"@\d+$")  # ops' per-device suffix, "@0"
_LEAF_TYPE = re.compile(r":\w+\[[\d, ]*\]$")  # ops' ":float32[3, 4]"
_PATH = re.compile(r"(?:\[[^\[\]]*\]|\.[A-Za-z_]\w*)+$")  # "['w'][0].b"


class CallCheck(NamedTuple):
    """The call check of one push_pull (see `call_check`).

    Attributes:
      call: the call's name, the same on every rank whatever its tree.
      wire_name: the name whose round counter numbers the check's rounds.
      key: the check's server key (from `call` alone).
      signature: a 64-bit hash of the names, shapes and dtypes (never 0).
      description: the tree for messages, at most `MAX_DESCRIPTION` chars.
    """

    call: str
    wire_name: str
    key: int
    signature: int
    description: str

    @property
    def salt(self) -> int:
        """The `make_plan` salt that sends a call of one piece to the
        check's `server`."""
        return topology.tensor_id(self.call)

    def server(self, num_servers: int) -> int:
        """The server the check goes to: chosen from `call` alone, so every
        rank's check lands on the same one whatever its plan."""
        return self.salt % num_servers


def _split_leaf(name: str, strip_path: bool = True) -> tuple[str, str, str]:
    """(call part, the leaf's own part, shard suffix) of a tensor name.

    A name the ops layer gave a leaf, ``f"{name}{path}:{dtype}{shape}@{d}"``
    (e.g. ``"grads['w']:float32[3, 4]@0"``), splits into ``"grads"``,
    ``"['w']:float32[3, 4]"`` and ``"@0"`` (with `strip_path` False:
    ``"grads['w']"``, ``":float32[3, 4]"``, ``"@0"``); any other name is its
    own call part.
    """
    shard = _SHARD.search(name)
    suffix = shard.group() if shard else ""
    stem = name[: len(name) - len(suffix)]
    leaf_type = _LEAF_TYPE.search(stem)
    if leaf_type is None:
        return stem, "", suffix
    base = stem[: leaf_type.start()]
    if strip_path:
        base = _PATH.sub("", base)
    return base, stem[len(base) :], suffix


def call_name(names: Sequence[str]) -> str:
    """The name of the call that pushes the tensors `names`.

    For the ops layer's leaf names (``"grads['w']:float32[3, 4]@0"``) it is
    the user's name with the device's shard suffix (``"grads@0"``): the
    leaves' ``:dtype[shape]`` is dropped and, for a call of several
    leaves, their paths (trailing ``[...]`` and ``.attr`` parts), so ranks
    whose trees differ in shape, dtype or structure still check on the same
    key. A call of one leaf keeps its path (``"grads['w']@0"``): the
    overlapped backward pass (`jaxps.value_and_grad`) pushes its buckets
    as calls of their own, in any order, and each must count its own
    checks (a bucket of several leaves passes its first leaf's call name).
    Other names (e.g. `push_pull_numpy`'s) are their own call; several
    distinct ones are joined with ``+``. Two calls of several leaves whose
    names differ only in a trailing path-like part share one check
    counter, so they must not be in flight at once (pass distinct names).
    """
    strip = len(names) > 1
    parts = dict.fromkeys(
        base + shard
        for base, _, shard in (_split_leaf(n, strip) for n in names)
    )
    return "+".join(parts)


def call_check(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence,
    call: str | None = None,
    crossing: str = "",
) -> CallCheck:
    """The call check of a push_pull of tensors named `names`.

    Args:
      names: the tensors' names (every leaf, empty ones too).
      shapes: the tensors' shapes.
      dtypes: the tensors' dtypes.
      call: the call's name; default `call_name(names)`.
      crossing: how the tensors travel, where the ranks must agree on it
        beyond the tree (the ops layer's fused leaves, which depend on the
        platform); part of the signature and the description.
    """
    call = call_name(names) if call is None else call
    items = []
    digest = hashlib.blake2b(digest_size=8)
    for name, shape, dtype in zip(names, shapes, dtypes):
        shape, dtype = tuple(shape), np.dtype(dtype)
        digest.update(f"{name}\0{shape}\0{dtype.str}\0".encode())
        _, leaf, _ = _split_leaf(name)
        if leaf:  # the ops layer's path and :dtype[shape] of the leaf
            path, _, leaf_type = leaf.rpartition(":")
            items.append(f"{path} {leaf_type}".strip())
        else:
            items.append(f"{name} {dtype}{list(shape)}")
    description = ", ".join(items)
    if crossing:
        digest.update(f"\0crossing\0{crossing}".encode())
        description = f"{description} ({crossing})"
    if len(description) > MAX_DESCRIPTION:
        description = description[: MAX_DESCRIPTION - 3] + "..."
    wire_name = "\0call:" + call
    return CallCheck(
        call=call,
        wire_name=wire_name,
        key=_wire.make_key(topology.tensor_id(wire_name), 0),
        signature=int.from_bytes(digest.digest(), "little") or 1,
        description=description,
    )
