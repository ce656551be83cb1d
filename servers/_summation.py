"""The summation service without gRPC: checks, push, pull and expiry.

`Summation` is what every transport of the server calls: the gRPC
servicer (`_service`) and the data channel (`_data`) only decode requests,
call it and encode its answers. A request is refused by raising
`_wire.Rejected`. All its methods run on the server's event loop.

A chunk's header `h` is any object with the attributes of `pb.Header`:
``version``, ``job_id``, ``session``, ``rank``, ``key``, ``round``,
``dtype``, ``length`` and ``name``; a call check's also has ``signature``
and ``description``, and a piece that carries one ``check_key``,
``check_round`` and ``check_call`` (see `_store.Store.begin_push`; others
may lack them).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import secrets
import time
from collections.abc import Callable

import numpy as np

from . import _async_store, _codec, _engine, _jobs, _rendezvous, _store, _wire

log = logging.getLogger("jaxps.server")


def _chunk(h) -> dict:
    """The header fields that name a chunk's round, as the store's
    keyword arguments."""
    return dict(
        key=h.key,
        round=h.round,
        rank=h.rank,
        dtype_code=h.dtype,
        length=h.length,
    )


def _settle(future: asyncio.Future, woken: bool) -> None:
    if not future.done():
        future.set_result(woken)


def _waker() -> tuple[asyncio.Future, Callable[[], None]]:
    """A future of the running loop and the callable that wakes it (once;
    later calls do nothing), for the waiter lists of rounds, sessions,
    contests and joins. Cheaper than an `asyncio.Event` and `wait_for`,
    which cost a task and a timer on every chunk's pull."""
    future = asyncio.get_running_loop().create_future()
    return future, functools.partial(_settle, future, True)


async def _set_by(future: asyncio.Future, deadline: float) -> bool:
    """Waits until the `_waker` `future` is woken or `deadline` (a
    `time.monotonic()` value) passes; returns whether it was woken."""
    if future.done():
        return future.result()
    loop = asyncio.get_running_loop()
    timer = loop.call_later(
        max(0.0, deadline - time.monotonic()), _settle, future, False
    )
    try:
        return await future
    finally:
        timer.cancel()


class Summation:
    """Sums the chunks pushed by `num_workers` ranks and answers pulls.

    Every request belongs to a job incarnation (`_jobs.Session`) that a
    Hello gave: its keys, rounds and segments are its own.

    Args:
      num_workers: number of worker ranks in a job.
      job_id: the only job this server serves; ``None`` serves any job
        (each in its own sessions).
      round_timeout: seconds before an incomplete round fails for everyone.
      engine_threads: threads that sum payloads (each key is pinned to one).
      deterministic: sum in rank order for bitwise reproducible results.
      async_mode: hold parameters and add deltas without rounds (BytePS
        async); see `_async_store`.
      max_memory: most bytes of accumulators and sums held at once, over
        all sessions (None: no cap).
      idle_timeout: a session idle this long drops its keys and rounds.
      claim_window: see `_jobs.Jobs` (None: its default).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        job_id: str | None = None,
        round_timeout: float = 60.0,
        engine_threads: int = 2,
        deterministic: bool = False,
        async_mode: bool = False,
        max_memory: int | None = None,
        idle_timeout: float = 600.0,
        claim_window: float | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        #: Random id of this server process, sent with every reply.
        self.incarnation = secrets.token_hex(8)
        self.async_mode = async_mode
        self.budget = _store.Budget(max_memory)
        self._store_args = dict(
            engine_threads=engine_threads,
            encode=self._encode_reply,
            budget=self.budget,
        )
        if not async_mode:
            self._store_args.update(
                round_timeout=round_timeout, deterministic=deterministic
            )
        self._num_workers = num_workers
        self.jobs = _jobs.Jobs(
            num_workers,
            self._new_store,
            job_id=job_id,
            round_timeout=round_timeout,
            idle_timeout=idle_timeout,
            claim_window=claim_window,
        )
        self.engines = _engine.Engines(engine_threads)
        # the PullReplies of a sum put into the puller's shared-memory
        # slot, by number of contributors
        self._in_slot_replies: dict[int, bytes] = {}
        # job id -> elastic membership (`_rendezvous`), oldest first
        self._rendezvous: dict[str, _rendezvous.Rendezvous] = {}
        self._probed: dict[str, float] = {}  # job id -> probe good until

    def _new_store(self, num_workers: int) -> _store.PushPullStore:
        if self.async_mode:
            return _async_store.AsyncStore(num_workers, **self._store_args)
        return _store.Store(num_workers, **self._store_args)

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def job_id(self) -> str | None:
        return self.jobs.job_id

    def _encode_reply(self, total, contributors: int = 0) -> bytes:
        return _codec.encode_pull_reply(
            self.incarnation, total, contributors=contributors
        )

    def in_slot_reply(self, contributors: int = 0) -> bytes:
        """The PullReply of a sum (over `contributors` ranks) put into the
        puller's shared-memory slot."""
        reply = self._in_slot_replies.get(contributors)
        if reply is None:
            reply = _codec.encode_pull_reply(
                self.incarnation, None, True, contributors
            )
            self._in_slot_replies[contributors] = reply
        return reply

    # -- checks ------------------------------------------------------------

    @staticmethod
    def check_version(version: int) -> None:
        if version != _wire.PROTOCOL_VERSION:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"protocol version mismatch: worker speaks version "
                f"{version}, server speaks {_wire.PROTOCOL_VERSION}; "
                "install the same jaxps on workers and servers.",
            )

    def check_header(self, h) -> _jobs.Session:
        """Checks the protocol version, job, rank and session of `h`;
        returns the session."""
        self.check_version(h.version)
        return self.jobs.get(h.job_id, h.session, h.rank)

    def hello(
        self,
        h,
        num_workers: int,
        *,
        init_id: str = "",
        timeout: float = 0.0,
        generation: int = 0,
        host: str = "",
    ) -> _jobs.Session:
        """Checks a worker's hello (header, rank and its `num_workers`);
        returns the session it joins (``h.session``, if not empty, is the
        one it was given before). Only a hello that passes every check
        starts or joins a session.

        An elastic hello (`generation` > 0, see `rendezvous`) brings the
        session's own `num_workers`; any other must match the server's.
        """
        self.check_version(h.version)
        self.jobs.check_job(h.job_id)
        if generation:
            if self.async_mode:
                raise _wire.Rejected(
                    "FAILED_PRECONDITION",
                    "elastic workers need synchronous servers: with --async "
                    "the servers hold the parameters of a fixed set of ranks.",
                )
            if not 1 <= num_workers <= _rendezvous.MAX_WAITING:
                raise _wire.Rejected(
                    "INVALID_ARGUMENT",
                    f"num_workers must be in [1, {_rendezvous.MAX_WAITING}]"
                    f", got {num_workers} (rank {h.rank}, generation "
                    f"{generation}).",
                )
        elif num_workers != self._num_workers:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"wrong num_workers: worker {h.rank} says "
                f"num_workers={num_workers}, server was started "
                f"with --num-workers {self._num_workers}.",
            )
        _store.check_rank(h.rank, num_workers)
        return self.jobs.hello(
            h.job_id,
            h.rank,
            h.session,
            init_id or h.session,
            timeout,
            num_workers=num_workers,
            generation=generation,
            host=host,
        )

    async def rendezvous(self, request, *, deadline: float):
        """An elastic worker's rendezvous (see `_rendezvous`): returns the
        generation that closed and its members, or with ``probe`` how many
        workers wait for the next one (then generation and members are
        the last)."""
        self.check_version(request.version)
        self.jobs.check_job(request.job_id)
        r = self._rendezvous.get(request.job_id)
        if r is None:
            if len(self._rendezvous) >= _jobs.MAX_SESSIONS:
                idle = [j for j, x in self._rendezvous.items() if not x.waiting]
                if not idle:
                    raise _wire.Rejected(
                        "RESOURCE_EXHAUSTED",
                        f"{len(self._rendezvous)} elastic jobs wait in a "
                        "rendezvous here, the most this server keeps.",
                    )
                del self._rendezvous[idle[0]]
                self._probed.pop(idle[0], None)
            job_id = request.job_id
            r = self._rendezvous[job_id] = _rendezvous.Rendezvous(
                job_id, lambda: self._running(job_id)
            )
        for name in ("settle", "timeout"):
            value = getattr(request, name)
            if not 0 <= value < math.inf:  # also NaN
                raise _wire.Rejected(
                    "INVALID_ARGUMENT",
                    f"rendezvous {name} must be finite and >= 0, got {value}.",
                )
        now = time.monotonic()
        if request.probe:
            self._probed[request.job_id] = now + request.timeout
            return r.generation, r.members, r.waiting
        generation, members = await r.arrive(
            request.member,
            request.generation,
            expected=request.expected,
            settle=request.settle,
            hint=request.hint,
            deadline=min(deadline, now + request.timeout),
        )
        log.info(
            "job %r generation %d: %d worker(s)",
            request.job_id,
            generation,
            len(members),
        )
        return generation, members, 0

    def _running(self, job_id: str) -> bool:
        """Whether elastic job `job_id` runs: a session of its last
        generation is live (not every rank said Bye) and was used, or
        probed by rank 0, within its workers' timeout."""
        generation = self._rendezvous[job_id].generation
        now = time.monotonic()
        for s in self.jobs:
            if s.job_id == job_id and s.generation == generation > 0:
                timeout = max(
                    (m.timeout for m in s.members.values()), default=0
                )
                timeout = timeout or self.jobs.round_timeout
                if now - s.last_seen < timeout:
                    return True
                if self._probed.get(job_id, 0.0) > now:
                    return True
        return False

    def bye(self, h) -> None:
        """Rank ``h.rank`` leaves its session (freed once all have)."""
        self.jobs.bye(self.check_header(h), h.rank)

    # -- shared memory -----------------------------------------------------

    def attach(self, h, fd: int, size: int) -> int:
        """Maps the sealed memfd `fd` (see `_shm`) of `size` bytes for rank
        ``h.rank``; returns the segment's id. The caller closes `fd`."""
        s = self.check_header(h)
        return s.segments.attach(h.rank, fd, size)

    def detach(self, h, segments) -> None:
        """Unmaps segments of rank ``h.rank`` (unknown ids are ignored)."""
        self.check_header(h).segments.detach(h.rank, segments)

    @staticmethod
    def slot(s: _jobs.Session, h, slot) -> memoryview:
        """The bytes of chunk `h` in a slot (``segment``, ``offset``) of a
        shared-memory segment of rank ``h.rank`` in session `s`."""
        try:
            itemsize = _wire.code_dtype(h.dtype).itemsize
        except KeyError:
            itemsize = 0  # the store names the bad dtype
        return s.segments.view(
            h.rank, slot.segment, slot.offset, h.length * itemsize
        )

    # -- push and pull -----------------------------------------------------

    async def push(self, h, payload, checksum: int, slot=None):
        """Accepts a push and schedules its sum; returns its payload (the
        memory of `slot` if one is named, which is then lent to the server
        until the rank's pull of the round returns).

        `payload` must stay valid until the round is complete (until the
        caller's pull returns). In async mode it returns once the push was
        added.
        """
        s = self.check_header(h)
        reason = getattr(h, "abort", "")
        if reason:  # the rank's call failed: the round fails for everyone
            s.store.abort(**_chunk(h), name=h.name, reason=reason)
            return payload
        if slot is not None:
            # A lent slot holds the sum once its round is complete, so a
            # replayed push from it cannot be checked against its checksum.
            payload = self.slot(s, h, slot)
        elif not self.async_mode:
            mine = _wire.fingerprint(payload)
            if mine != checksum:
                raise _wire.Rejected(
                    "INVALID_ARGUMENT",
                    f"checksum {checksum:#010x} of the push of key {h.key} "
                    f"({h.name}) round {h.round} by rank {h.rank} is not its "
                    f"payload's ({mine:#010x}: crc32 of its length and first "
                    "and last 4 KiB).",
                )
        store = s.store
        ticket = store.begin_push(
            **_chunk(h),
            payload=payload,
            checksum=checksum,
            name=h.name,
            lent=slot is not None,
            signature=getattr(h, "signature", 0),
            description=getattr(h, "description", ""),
            check_key=getattr(h, "check_key", 0),
            check_round=getattr(h, "check_round", 0),
            check_call=getattr(h, "check_call", ""),
        )
        if ticket is not None:  # else an identical retry
            await self.engines.sum(ticket, store)
        return payload

    async def pull(
        self, h, *, deadline: float, raw: bool = False, into=None, slot=None
    ) -> bytes | np.ndarray:
        """Waits until the round of `h` is complete; returns its sum.

        The sum comes as an encoded PullReply, or with `raw` as a numpy
        array (valid until the key's round after next is summed). With
        `into` (a writable buffer, e.g. the slot the push was lent from) the
        sum is put there and the reply says so (with `raw`: a numpy view of
        `into`). Raises DEADLINE_EXCEEDED, naming the ranks that did not
        push, if the round is incomplete at `deadline` (a
        `time.monotonic()` value), at the worker's own timeout (from its
        Hello) or at the round's deadline. `slot` (a `pb.ShmSlot`) names
        `into` in the rank's shared memory instead.
        """
        result, _ = await self.pull_counted(
            h, deadline=deadline, raw=raw, into=into, slot=slot
        )
        return result

    async def pull_counted(
        self,
        h,
        *,
        deadline: float,
        raw: bool = False,
        into=None,
        slot=None,
        on_wait: Callable[[], None] | None = None,
    ) -> tuple[bytes | np.ndarray, int]:
        """`pull`, and how many ranks the sum is over (fewer than
        num_workers while some have joined; 0 from async servers).
        `on_wait` is called once if the sum is not ready at once, before
        the pull waits for it."""
        s = self.check_header(h)
        if slot is not None:
            into = self.slot(s, h, slot)
        store = s.store
        rnd, result = store.pull(**_chunk(h), raw=raw, into=into)
        if result is None:
            timeout = s.members[h.rank].timeout
            if timeout > 0:
                deadline = min(deadline, time.monotonic() + timeout)
        if on_wait is not None and (result is None or s.contest is not None):
            on_wait()
        while result is None:  # again while its call check is not agreed
            await self._wait(s, rnd, deadline)
            result = store.collect(
                h.key,
                rnd,
                h.rank,
                raw=raw,
                into=into,
                now=time.monotonic(),
                until=deadline,
            )
        if s.contest is not None:
            await self._settled(s, h, deadline)
        contributors = 0 if rnd is None else rnd.summed
        if into is None:
            return result, contributors
        if raw:
            array = np.frombuffer(into, _wire.code_dtype(h.dtype), h.length)
            return array, contributors
        return self.in_slot_reply(contributors), contributors

    async def join(self, h, *, deadline: float) -> int:
        """Rank ``h.rank`` joins epoch ``h.round`` (see `_join`): rounds
        complete without it from now on. Returns, once every rank has
        joined, the rank that joined last; raises DEADLINE_EXCEEDED naming
        the ranks that have not joined at `deadline`."""
        s = self.check_header(h)
        if self.async_mode:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                "join needs synchronous servers: with --async no round "
                "waits for another rank.",
            )
        joins = s.joins
        if joins.join(h.rank, h.round):
            s.store.reset_rounds()
            joins.end()
            log.info("%s: every rank joined (epoch %d)", s.label(), h.round)
        elif h.round == joins.epoch:
            s.store.join(frozenset(joins.joined))
            woken, wake = _waker()
            joins.wait(wake)
            if not await _set_by(woken, deadline):
                raise _wire.Rejected(
                    "DEADLINE_EXCEEDED",
                    f"join of rank {h.rank} timed out waiting for rank(s) "
                    f"{joins.missing()} to join (ranks {sorted(joins.joined)} "
                    "did); the rank stays joined.",
                )
        return joins.last

    @staticmethod
    async def _wait(s: _jobs.Session, rnd, deadline: float) -> None:
        """Waits for `rnd` to complete, fail, or its session to end."""
        woken, wake = _waker()
        rnd.waiters.append(wake)
        cancel = s.on_end(wake)
        try:  # (if it times out, `collect` tells whether the round failed)
            await _set_by(woken, min(rnd.deadline, deadline))
        finally:
            cancel()
        if s.ended is not None:
            raise _wire.Rejected("FAILED_PRECONDITION", s.ended)

    @staticmethod
    async def _settled(s: _jobs.Session, h, deadline: float) -> None:
        """Holds back a sum of `s` while another process claims one of its
        ranks (see `_jobs`); raises if the claim ended the session."""
        contest = s.contest
        woken, wake = _waker()
        contest.on_settled(wake)
        if not await _set_by(woken, deadline):
            raise _wire.Rejected(
                "DEADLINE_EXCEEDED",
                f"the sum of {h.name!r} round {h.round} is held back: rank "
                f"{contest.rank} of {s.label()} is claimed by two processes "
                f"({contest.hosts}) and the claim was not settled in time.",
            )
        if contest.why is not None:
            raise _wire.Rejected("FAILED_PRECONDITION", contest.why)

    # -- life --------------------------------------------------------------

    async def expire_forever(self, period: float = 1.0) -> None:
        """Fails late rounds every `period` seconds (a background task)."""
        while True:
            await asyncio.sleep(period)
            failed = self.jobs.expire()
            if failed:
                log.warning("%d round(s) timed out", failed)

    def close(self) -> None:
        """Stops the engine threads and frees every session."""
        self.engines.close()
        self.jobs.close()
