"""The jobs a server serves, each as a series of incarnations (sessions).

A server outlives jobs. Every `jaxps.init` of a job starts or joins one
*session*: a namespace of keys, rounds and shared-memory segments that no
other job, and no other init of the same job, shares. So a second job
against the same servers, or a re-init in one process that reuses names,
never sees the rounds or sums of the first.

Agreement comes through the server, without a coordinator: a worker's first
Hello joins the session of its job that is forming (one its rank is not in
yet), or starts a new one. Other channels of the same worker name the same
`init_id`; a reconnect names the session it was given. A server that
restarted adopts a session it never saw from such a reconnect (its workers
bring it back, and their pushes its rounds: failover), unless it is one
that ended here.

A new init of a job whose current session is complete forms a session of
its own, which becomes current (superseding the old one) only once every
rank has joined it: a stray init, or a second job under the same job id,
never replaces a running job by itself. A process that claims a rank of
the current session within ``claim_window`` seconds (`CLAIM_WINDOW`) of its
holder's Hello *contests* it: the session's sums are held back (pushes are
still summed) until either the claimant's session completes (a second job
under the same id: both go on) or the window passes after the claim (two
processes believe they are rank r, e.g. a stray init between a job's real
ranks): then both sessions end, and every member's waiting or next call
fails naming the rank and both hosts, so nothing is summed with an
intruder. Without a token this guards against accidents, not attackers.

A session is freed when every rank said Bye, when it was superseded by a
newer one of its job and then idle for two round timeouts, or when it
never completed its membership and was idle that long; an idle session
drops its keys and rounds after ``idle_timeout``. Nothing else is kept per
job, so a server's memory is that of its live sessions.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

from . import _join, _shm, _store, _wire
from ._store import PushPullStore

log = logging.getLogger("jaxps.server")

#: Most sessions a server keeps at once (live or superseded).
MAX_SESSIONS = 64
#: Ended sessions remembered, so that a late reconnect cannot revive one.
MAX_ENDED = 4096
#: Seconds after a rank's Hello in which another process claiming the same
#: rank contests the session, and seconds a contest may last before it is
#: a conflict (default of ``--claim-window``).
CLAIM_WINDOW = 30.0


class Contest:
    """A claim on a rank of a session by another process's session.

    The claimed session's pulls wait (`wait`) until the claimant completes
    its membership (`release`: a second job) or the contest ends both
    (`end` with the reason: a conflict)."""

    def __init__(self, claimant: Session, rank: int, hosts: str, now: float):
        self.claimant = claimant
        self.rank = rank
        self.hosts = hosts
        self.since = now
        self.why: str | None = None
        self.settled = False
        self._waiters: list[Callable[[], None]] = []

    def on_settled(self, wake: Callable[[], None]) -> None:
        """Calls `wake` once the contest is released or ended."""
        if self.settled:
            wake()
        else:
            self._waiters.append(wake)

    def _settle(self, why: str | None) -> None:
        self.why, self.settled = why, True
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def release(self) -> None:
        self._settle(None)

    def end(self, why: str) -> None:
        self._settle(why)


def _trim_heap() -> None:
    """Hands freed heap memory back to the OS (glibc keeps it otherwise:
    sums of a few MiB live on the heap once the mmap threshold has grown)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclasses.dataclass
class Member:
    """A rank in a session: the init it belongs to, its pull timeout and
    the host it said Hello from."""

    init_id: str
    timeout: float = 0.0  # seconds the worker waits for a sum; 0: unknown
    host: str = ""
    joined: float = 0.0  # when it said its first Hello (monotonic)


class Session:
    """One incarnation of a job: its store, segments, members and the
    ranks that have joined (`jaxps.join`); `generation` is its elastic
    membership generation (0: not elastic)."""

    def __init__(
        self,
        sid: str,
        job_id: str,
        store: PushPullStore,
        now,
        generation: int = 0,
    ):
        self.id = sid
        self.job_id = job_id
        self.generation = generation
        self.store = store
        self.segments = _shm.Segments(getattr(store, "budget", None))
        self.members: dict[int, Member] = {}
        self.left: set[int] = set()
        self.joins = _join.JoinBarrier(store.num_workers)
        self.last_seen = now
        #: when a newer session of the job replaced it (None: it did not)
        self.superseded: float | None = None
        #: when every rank had joined (None: its membership is forming)
        self.formed: float | None = None
        #: a claim on one of its ranks by another process, while unsettled
        self.contest: Contest | None = None
        #: the session whose rank this one claims (while forming)
        self.claims: Session | None = None
        #: why it ended (None: live), and who waits to hear it
        self.ended: str | None = None
        self._on_end: set[Callable[[], None]] = set()

    def on_end(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Calls `wake` when the session ends; returns a callable that
        cancels this."""
        self._on_end.add(wake)
        return lambda: self._on_end.discard(wake)

    def end(self, why: str) -> None:
        self.ended = why
        waiters, self._on_end = self._on_end, set()
        for wake in waiters:
            wake()

    @property
    def num_workers(self) -> int:
        return self.store.num_workers

    def label(self) -> str:
        if self.generation:
            return (
                f"job {self.job_id!r} incarnation {self.id} (generation "
                f"{self.generation})"
            )
        return f"job {self.job_id!r} incarnation {self.id}"


class Jobs:
    """The sessions of every job a server serves.

    Args:
      num_workers: ranks per job (an elastic session's own come with its
        Hello).
      make_store: returns a new, empty store for a session of a number of
        ranks.
      job_id: the only job served (``--job-id``); None serves any job.
      round_timeout: the stores' round timeout (a superseded session is
        freed once idle twice this long).
      idle_timeout: a session idle this long drops its keys and rounds.
      max_sessions: most sessions kept at once.
      claim_window: seconds after a rank's Hello in which another process
        claiming it ends the session (None: `CLAIM_WINDOW`).
    """

    def __init__(
        self,
        num_workers: int,
        make_store: Callable[[int], PushPullStore],
        *,
        job_id: str | None = None,
        round_timeout: float = 60.0,
        idle_timeout: float = 600.0,
        max_sessions: int = MAX_SESSIONS,
        claim_window: float | None = None,
    ):
        self.num_workers = num_workers
        self.claim_window = claim_window
        self.job_id = job_id
        self._make_store = make_store
        self.round_timeout = round_timeout
        self.idle_timeout = max(idle_timeout, round_timeout)
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        #: job id -> the session new ranks join, or the running one
        self._current: dict[str, Session] = {}
        #: job id -> newer sessions forming beside a complete current one
        self._forming: dict[str, list[Session]] = {}
        #: ended session id -> why (never adopted again)
        self._ended: collections.OrderedDict[str, str] = (
            collections.OrderedDict()
        )
        # counters of freed sessions, so the metrics never go back
        self._retired = dict(bytes_summed=0, rounds_completed=0)

    # -- checks ------------------------------------------------------------

    def check_job(self, job_id: str) -> None:
        """Refuses a job other than ``--job-id`` (without naming it)."""
        if self.job_id is not None and job_id != self.job_id:
            raise _wire.Rejected(
                "PERMISSION_DENIED",
                f"unknown job_id {job_id!r}: this server was started with "
                "--job-id for another job.",
            )

    def get(
        self, job_id: str, sid: str, rank: int, now: float | None = None
    ) -> Session:
        """The session a request names; raises if it is unknown, another
        job's, or `rank` never said Hello in it."""
        s = self._sessions.get(sid)
        if s is None or s.job_id != job_id:
            self.check_job(job_id)
            why = self._ended.get(sid) if s is None else None
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"job incarnation {sid!r} of job {job_id!r} ended: {why}"
                if why
                else f"job incarnation {sid!r} of job {job_id!r} is unknown "
                "to this server: it ended (every rank said Bye, or a newer "
                "init of the job replaced it) or the server restarted; say "
                "Hello first.",
            )
        _store.check_rank(rank, s.num_workers)
        if rank not in s.members:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"rank {rank} has not said Hello in {s.label()}.",
            )
        s.last_seen = time.monotonic() if now is None else now
        return s

    # -- hello and bye -----------------------------------------------------

    def hello(
        self,
        job_id: str,
        rank: int,
        sid: str,
        init_id: str,
        timeout: float = 0.0,
        now: float | None = None,
        *,
        num_workers: int | None = None,
        generation: int = 0,
        host: str = "",
    ) -> Session:
        """The session of a checked Hello (see the module docstring).

        An elastic Hello (`generation` > 0) joins only a session of its
        generation, which has `num_workers` ranks of its own. `host` names
        the worker's host in conflict messages.
        """
        self.check_job(job_id)
        now = time.monotonic() if now is None else now
        n = self.num_workers if num_workers is None else num_workers
        if sid:  # a reconnect: the session it was given
            s = self._sessions.get(sid)
            if s is None and sid not in self._ended:
                # This server restarted: the workers bring their session
                # back, and their pushes its rounds (failover).
                s = self._start(job_id, now, n, generation, sid)
            if s is None or s.job_id != job_id:
                self.get(job_id, sid, rank, now)  # raises: unknown
            self._check_size(s, rank, n, generation)
            s.last_seen = now
            return self._join(s, rank, init_id, timeout, host, now)
        s = self._current.get(job_id)
        if s is not None and generation and s.generation > generation:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"rank {rank} says Hello for generation {generation} of job "
                f"{job_id!r}, but {s.label()} is newer: rendezvous again.",
            )
        forming = self._forming.get(job_id, [])
        for f in ([s] if s is not None else []) + forming:
            if f.generation != generation:
                continue
            member = f.members.get(rank)
            forming_without_it = member is None and f.formed is None
            if forming_without_it or (
                member is not None and member.init_id == init_id  # (a channel)
            ):
                self._check_size(f, rank, n, generation)
                f.last_seen = now
                return self._join(f, rank, init_id, timeout, host, now)
        # A new init of the job: an incarnation of its own, which replaces
        # the current one only once all its ranks have joined.
        f = self._start(job_id, now, n, generation)
        self._join(f, rank, init_id, timeout, host, now)
        member = None if s is None else s.members.get(rank)
        if (
            member is not None
            and s.contest is None
            and f.formed is None
            and rank not in s.left  # (a rank that said Bye may init again)
            and now - member.joined < self._window()
        ):
            hosts = (
                f"one from {member.host or 'an unknown host'} and a later one "
                f"from {host or 'an unknown host'}"
            )
            s.contest = Contest(f, rank, hosts, now)
            f.claims = s
            log.info("%s: rank %d claimed again (%s)", s.label(), rank, hosts)
        return f

    def _window(self) -> float:
        if self.claim_window is None:
            return CLAIM_WINDOW  # (read late: tests change it)
        return self.claim_window

    def _conflict(self, s: Session) -> None:
        """A contest on `s` outlived the window: ends `s` and its claimant,
        naming the rank and both hosts to every member."""
        contest = s.contest
        why = (
            f"{_wire.CLAIM_CONFLICT} {contest.rank} of job {s.job_id!r}: "
            f"{contest.hosts} (incarnations {s.id} and "
            f"{contest.claimant.id}). Give each process its own "
            "JAXPS_WORKER_RANK, and each job its own JAXPS_JOB_ID (jaxps-"
            "launch does); both incarnations ended, nothing was summed "
            "across them."
        )
        log.warning("%s", why)
        self.free(s, why)  # (first: its contest ends with `why`)
        self.free(contest.claimant, why)

    @staticmethod
    def _check_size(s: Session, rank: int, n: int, generation: int) -> None:
        if n != s.num_workers or generation != s.generation:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"rank {rank} says num_workers={n} generation {generation}, "
                f"but {s.label()} has num_workers={s.num_workers} generation "
                f"{s.generation}.",
            )

    def _join(
        self, s: Session, rank, init_id, timeout, host="", now=None
    ) -> Session:
        member = s.members.get(rank)
        if member is not None and member.init_id != init_id:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"rank {rank} of {s.label()} belongs to another worker "
                "process: two workers claim the same rank.",
            )
        now = time.monotonic() if now is None else now
        joined = now if member is None else member.joined
        s.members[rank] = Member(init_id, float(timeout), host, joined)
        s.left.discard(rank)
        if s.formed is None and len(s.members) >= s.num_workers:
            self._formed(s, now)
        return s

    def _formed(self, s: Session, now: float) -> None:
        """Every rank joined `s`: it becomes its job's current session (and
        a session it claimed a rank of goes on: a second job)."""
        s.formed = now
        claimed, s.claims = s.claims, None
        if claimed is not None and claimed.contest is not None:
            contest, claimed.contest = claimed.contest, None
            contest.release()
        forming = self._forming.get(s.job_id, [])
        if s in forming:
            forming.remove(s)
            if not forming:
                del self._forming[s.job_id]
        old = self._current.get(s.job_id)
        if old is not None and old is not s:
            old.superseded = now
            log.info("%s replaced by %s", old.label(), s.id)
        self._current[s.job_id] = s

    def _start(
        self,
        job_id: str,
        now: float,
        num_workers: int,
        generation: int = 0,
        sid: str | None = None,
    ) -> Session:
        """A new session; the job's current one if it has none, the current
        one is still forming or of an older elastic generation (else it
        forms beside it)."""
        if len(self._sessions) >= self.max_sessions:
            self.expire(now)
        if len(self._sessions) >= self.max_sessions:
            raise _wire.Rejected(
                "RESOURCE_EXHAUSTED",
                f"this server holds {len(self._sessions)} job incarnations "
                "(the most it keeps) and none has been idle for "
                f"{self.round_timeout:g} s; wait for a job to end.",
            )
        s = Session(
            sid or secrets.token_hex(8),
            job_id,
            self._make_store(num_workers),
            now,
            generation,
        )
        self._sessions[s.id] = s
        old = self._current.get(job_id)
        # (a later elastic generation replaces at once: the rendezvous
        # already agreed on its members)
        if (
            old is None
            or old.formed is None
            or sid
            or generation > old.generation
        ):
            if old is not None and old is not s:
                old.superseded = now
            self._current[job_id] = s
        else:
            self._forming.setdefault(job_id, []).append(s)
        log.info("%s %s", s.label(), "adopted" if sid else "started")
        return s

    def bye(self, s: Session, rank: int) -> None:
        """`rank` left; frees the session once every member has."""
        s.left.add(rank)
        if s.left >= set(s.members):
            self.free(s, "every rank said Bye")

    def free(self, s: Session, why: str) -> None:
        """Drops a session's keys, rounds and segments."""
        if self._sessions.pop(s.id, None) is None:
            return
        s.end(why)  # its waiting pulls hear why
        if s.contest is not None:
            contest, s.contest = s.contest, None
            contest.end(why)
        claimed, s.claims = s.claims, None
        if claimed is not None and claimed.contest is not None:
            contest, claimed.contest = claimed.contest, None
            contest.release()  # the claimant gave up: no conflict
        self._ended[s.id] = why  # never adopted again
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        if self._current.get(s.job_id) is s:
            del self._current[s.job_id]
        forming = self._forming.get(s.job_id, [])
        if s in forming:
            forming.remove(s)
            if not forming:
                del self._forming[s.job_id]
        self._retire(s.store)
        s.segments.close()
        log.info("%s freed: %s", s.label(), why)
        _trim_heap()

    def _retire(self, store: PushPullStore) -> None:
        self._retired["bytes_summed"] += store.bytes_summed
        self._retired["rounds_completed"] += store.rounds_completed
        store.close()

    # -- expiry ------------------------------------------------------------

    def expire(self, now: float | None = None) -> int:
        """Fails late rounds and frees idle sessions; returns how many
        rounds failed."""
        now = time.monotonic() if now is None else now
        failed = 0
        for s in list(self._sessions.values()):
            contest = s.contest
            if contest is not None and now - contest.since >= self._window():
                self._conflict(s)
        for s in list(self._sessions.values()):
            idle = now - s.last_seen
            # twice the round timeout: no pull of it can still be waiting
            if s.superseded is not None and idle >= 2 * self.round_timeout:
                self.free(s, "a newer init of the job replaced it")
                continue
            if s.formed is None and idle >= 2 * self.round_timeout:
                self.free(s, "not every rank joined it")
                continue
            failed += s.store.expire(now)
            if idle >= self.idle_timeout and s.store.num_keys:
                self._retire(s.store)
                s.store = self._make_store(s.num_workers)
                s.store.join(frozenset(s.joins.joined))
                _trim_heap()
                log.info(
                    "%s idle for %.0f s: its keys were dropped", s.label(), idle
                )
        return failed

    def close(self) -> None:
        for s in list(self._sessions.values()):
            self.free(s, "the server is stopping")

    # -- metrics (summed over sessions) -------------------------------------

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def bytes_summed(self) -> int:
        return self._retired["bytes_summed"] + sum(
            s.store.bytes_summed for s in self
        )

    @property
    def rounds_completed(self) -> int:
        return self._retired["rounds_completed"] + sum(
            s.store.rounds_completed for s in self
        )

    @property
    def last_round_by_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self:
            for rank, rnd in s.store.last_round_by_rank.items():
                out[rank] = max(rnd, out.get(rank, -1))
        return out

    @property
    def num_keys(self) -> int:
        return sum(s.store.num_keys for s in self)

    def pending_pulls(self) -> int:
        return sum(s.store.pending_pulls() for s in self)

    def pending_rounds(self) -> int:
        return sum(s.store.pending_rounds() for s in self)
