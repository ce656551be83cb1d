"""The gRPC-free core of the service, driven as the data channel does."""

import asyncio
import time
import types

import numpy as np
import pytest

from jaxps.servers import _codec, _jobs, _summation, _wire
from jaxps.servers import jaxps_pb2 as pb


def header(rank, array, rnd=0, key=5, job_id="job", version=None, session=None):
    return types.SimpleNamespace(
        version=_wire.PROTOCOL_VERSION if version is None else version,
        job_id=job_id,
        session=SESSIONS.get(job_id, "") if session is None else session,
        rank=rank,
        key=key,
        round=rnd,
        dtype=_wire.dtype_code(array.dtype),
        length=array.size,
        name="w",
    )


#: the session the last `join` gave, per job id (headers default to it)
SESSIONS: dict[str, str] = {}


def hello(core, rank, job_id="job", init_id=None, session="", **kw):
    h = types.SimpleNamespace(
        version=_wire.PROTOCOL_VERSION,
        job_id=job_id,
        rank=rank,
        session=session,
    )
    init_id = init_id or f"init-of-{rank}"
    return core.hello(h, core.num_workers, init_id=init_id, **kw).id


def join(core, job_id="job", **kw):
    """Every rank says hello; returns (and remembers) their session."""
    ids = {hello(core, r, job_id, **kw) for r in range(core.num_workers)}
    assert len(ids) == 1, ids
    SESSIONS[job_id] = ids.pop()
    return SESSIONS[job_id]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("async_mode", [False, True])
def test_push_then_pull_raw_and_encoded(async_mode):
    async def main():
        core = _summation.Summation(2, async_mode=async_mode)
        join(core)
        try:
            x = np.arange(6, dtype=np.float32)
            far = time.monotonic() + 10
            for rank in range(2):
                payload = (x * (rank + 1)).tobytes()
                h = header(rank, x)
                await core.push(h, payload, _wire.fingerprint(payload))
            expected = x if async_mode else 3 * x  # async: round 0 sets
            raw = await core.pull(header(0, x), deadline=far, raw=True)
            np.testing.assert_array_equal(raw, expected)
            reply = pb.PullReply.FromString(
                await core.pull(header(1, x), deadline=far)
            )
            assert reply.incarnation == core.incarnation
            np.testing.assert_array_equal(
                np.frombuffer(reply.payload, np.float32), expected
            )
        finally:
            core.close()

    run(main())


def test_pull_returns_when_the_last_rank_pushes():
    async def main():
        core = _summation.Summation(2)
        join(core)
        try:
            x = np.ones(4, np.float32)
            far = time.monotonic() + 10
            await core.push(header(0, x), x.tobytes(), _wire.fingerprint(x))
            pull = asyncio.ensure_future(
                core.pull(header(0, x), deadline=far, raw=True)
            )
            await asyncio.sleep(0.05)
            assert not pull.done()  # the round is incomplete
            await core.push(header(1, x), x.tobytes(), _wire.fingerprint(x))
            np.testing.assert_array_equal(await pull, 2 * x)
        finally:
            core.close()

    run(main())


def test_pull_deadline_names_the_missing_ranks():
    async def main():
        core = _summation.Summation(3)
        join(core)
        try:
            x = np.ones(2, np.float32)
            await core.push(header(1, x), x.tobytes(), _wire.fingerprint(x))
            with pytest.raises(_wire.Rejected) as e:
                await core.pull(header(1, x), deadline=time.monotonic() + 0.05)
            assert e.value.code == "DEADLINE_EXCEEDED"
            assert "waiting for rank(s) [0, 2]" in e.value.message
        finally:
            core.close()

    run(main())


def test_header_checks():
    core = _summation.Summation(2, job_id="a")
    try:
        x = np.ones(1, np.float32)
        join(core, "a")
        core.check_header(header(0, x, job_id="a"))
        with pytest.raises(_wire.Rejected, match="unknown job_id 'b'") as e:
            hello(core, 0, "b")
        assert e.value.code == "PERMISSION_DENIED"
        assert "'a'" not in e.value.message  # another job's id stays secret
        with pytest.raises(_wire.Rejected, match="version mismatch"):
            core.check_header(header(0, x, job_id="a", version=1))
        with pytest.raises(_wire.Rejected, match="rank 2 out of range"):
            core.hello(header(2, x, job_id="a"), 2)
        with pytest.raises(_wire.Rejected, match="rank 2 out of range"):
            core.check_header(header(2, x, job_id="a"))
        with pytest.raises(_wire.Rejected, match="wrong num_workers"):
            core.hello(header(0, x, job_id="a"), 3)
        with pytest.raises(_wire.Rejected, match="is unknown") as e:
            core.check_header(header(0, x, job_id="a", session="nope"))
        assert e.value.code == "FAILED_PRECONDITION"
    finally:
        core.close()


def test_a_rejected_hello_locks_nothing():
    core = _summation.Summation(2)
    try:
        h = types.SimpleNamespace(
            version=_wire.PROTOCOL_VERSION, job_id="evil", rank=0, session=""
        )
        with pytest.raises(_wire.Rejected, match="wrong num_workers"):
            core.hello(h, 99)
        assert len(core.jobs) == 0
        join(core, "real")  # the real job is served
        assert [s.job_id for s in core.jobs] == ["real"]
    finally:
        core.close()


def test_jobs_and_inits_are_separate_namespaces(monkeypatch):
    # a new init long after the first formed (not a conflicting claim)
    monkeypatch.setattr(_jobs, "CLAIM_WINDOW", 0.0)

    async def main():
        core = _summation.Summation(2)
        try:
            x = np.ones(2, np.float32)
            far = time.monotonic() + 10

            async def step(job, rnd, scale, pullers=(0, 1)):
                for r in range(2):
                    h = header(r, x, rnd=rnd, job_id=job)
                    await core.push(
                        h, (scale * x).tobytes(), _wire.fingerprint(scale * x)
                    )
                for r in pullers:
                    h = header(r, x, rnd=rnd, job_id=job)
                    total = await core.pull(h, deadline=far, raw=True)
                return total.copy()

            first = join(core, "j")
            for rnd in range(3):
                await step("j", rnd, 1.0, pullers=(0, 1) if rnd < 2 else (0,))
            join(core, "other")  # another job at the same time: its own keys
            np.testing.assert_array_equal(await step("other", 0, 5.0), 10 * x)
            # A new init of job "j" (new init ids) starts a new incarnation:
            # round 0 again, and never the old sum.
            second = join(core, "j", init_id="again")
            assert second != first
            np.testing.assert_array_equal(await step("j", 0, 3.0), 6 * x)
            # the old incarnation still answers its own stragglers
            h = header(1, x, rnd=2, job_id="j", session=first)
            total = await core.pull(h, deadline=far, raw=True)
            np.testing.assert_array_equal(total, 2 * x)
        finally:
            core.close()

    run(main())


def test_same_init_joins_and_reconnects_keep_the_session():
    core = _summation.Summation(2)
    try:
        sid = hello(core, 0, init_id="w0")
        assert hello(core, 0, init_id="w0") == sid  # a second channel
        assert hello(core, 1, init_id="w1") == sid
        assert hello(core, 1, init_id="w1", session=sid) == sid  # reconnect
        with pytest.raises(_wire.Rejected, match="two workers claim"):
            hello(core, 1, init_id="intruder", session=sid)
    finally:
        core.close()


def test_a_stray_init_never_replaces_a_running_job(monkeypatch):
    """An init of a rank of a complete, running session forms an
    incarnation of its own; it replaces the running one only once every
    rank joined it, and is freed if that never happens."""
    monkeypatch.setattr(_jobs, "CLAIM_WINDOW", 0.0)
    core = _summation.Summation(2, round_timeout=1.0)
    try:
        real = join(core)
        stray = hello(core, 1, init_id="stray")
        assert stray != real
        # the real job is still current: its ranks' other channels join it
        assert hello(core, 0) == real and hello(core, 1) == real
        now = time.monotonic()
        core.jobs.expire(now + 2.5)  # the stray never completed: freed
        assert {s.id for s in core.jobs} == {real}
        core.check_header(header(0, np.ones(1), session=real))
        # a full new membership (a second job under the same id) replaces
        second = {hello(core, r, init_id=f"second-{r}") for r in range(2)}
        assert len(second) == 1 and real not in second
        core.check_header(header(1, np.ones(1), session=real))  # still served
        core.jobs.expire(time.monotonic() + 2.5)  # superseded and idle
        assert {s.id for s in core.jobs} == second
    finally:
        core.close()


def test_two_processes_claiming_a_rank_are_named_to_both(monkeypatch):
    """A stray init takes rank 1 before the real one, which then claims it
    too: the session's sums are held back, and once the claim window
    passes without the claimant's session completing, both sessions end
    naming the rank and both hosts; nothing was summed with the intruder."""
    monkeypatch.setattr(_jobs, "CLAIM_WINDOW", 0.5)

    async def main():
        core = _summation.Summation(2)
        try:
            x = np.ones(2, np.float32)
            sid = hello(core, 0, host="10.0.0.1")
            assert hello(core, 1, init_id="stray", host="10.0.0.9") == sid
            real = hello(core, 1, init_id="real-1", host="10.0.0.2")
            assert real != sid
            for rank in range(2):  # rank 0 and the stray push
                h = header(rank, x, session=sid)
                await core.push(h, x.tobytes(), _wire.fingerprint(x))
            far = time.monotonic() + 10
            pull = core.pull(header(0, x, session=sid), deadline=far, raw=True)
            waiting = core.pull(header(1, x, session=real), deadline=far)
            await core.push(
                header(1, x, session=real), x.tobytes(), _wire.fingerprint(x)
            )
            tasks = [asyncio.ensure_future(p) for p in (pull, waiting)]
            await asyncio.sleep(0.6)
            core.jobs.expire()  # the window passed: a conflict
            for task in tasks:  # both waiting pulls hear it, at once
                with pytest.raises(_wire.Rejected, match="claim rank 1") as e:
                    await asyncio.wait_for(task, 2)
                for host in ("10.0.0.9", "10.0.0.2"):
                    assert host in e.value.message
            for session in (sid, real):  # and every later call
                with pytest.raises(_wire.Rejected, match="claim rank 1"):
                    core.check_header(header(0, x, session=session))
        finally:
            core.close()

    run(main())


def test_a_second_job_under_the_same_id_settles_the_claim():
    """Two jobs with the default job id started together: the second's
    ranks claim the first's, its session completes, and both go on."""

    async def main():
        core = _summation.Summation(2)
        try:
            x = np.ones(2, np.float32)
            first = join(core, init_id="a")
            for rank in range(2):
                h = header(rank, x, session=first)
                await core.push(h, x.tobytes(), _wire.fingerprint(x))
            held = asyncio.ensure_future(
                core.pull(
                    header(0, x, session=first),
                    deadline=time.monotonic() + 10,
                    raw=True,
                )
            )
            second = hello(core, 0, init_id="b0")
            await asyncio.sleep(0.1)
            assert not held.done()  # held while rank 0 is claimed twice
            assert hello(core, 1, init_id="b1") == second != first
            np.testing.assert_array_equal(
                await asyncio.wait_for(held, 2), 2 * x
            )
        finally:
            core.close()

    run(main())


def test_sessions_are_freed_by_bye_and_by_idling(monkeypatch):
    monkeypatch.setattr(_jobs, "CLAIM_WINDOW", 0.0)  # inits far apart

    async def main():
        core = _summation.Summation(2, round_timeout=1.0, idle_timeout=5.0)
        try:
            x = np.ones(1000, np.float32)
            sid = join(core)
            for r in range(2):
                await core.push(header(r, x), x.tobytes(), _wire.fingerprint(x))
            assert core.jobs.num_keys == 1 and core.budget.held > 0
            core.bye(header(0, x))
            assert len(core.jobs) == 1  # rank 1 is still in it
            core.bye(header(1, x))
            assert len(core.jobs) == 0 and core.budget.held == 0
            with pytest.raises(
                _wire.Rejected, match="ended: every rank said Bye"
            ):
                core.check_header(header(0, x, session=sid))
            # superseded by a newer init, then idle a round timeout: freed
            old = join(core, init_id="a")
            join(core, init_id="b")
            now = time.monotonic()
            core.jobs.expire(now + 1.5)
            assert old in {s.id for s in core.jobs}
            core.jobs.expire(now + 2.5)
            assert old not in {s.id for s in core.jobs}
            # the current one, idle past idle_timeout, drops its keys only
            for r in range(2):
                await core.push(header(r, x), x.tobytes(), _wire.fingerprint(x))
            assert core.jobs.num_keys == 1
            core.jobs.expire(time.monotonic() + 6.0)
            assert core.jobs.num_keys == 0 and len(core.jobs) == 1
            assert core.budget.held == 0
            # and takes up its rounds again where the workers are
            for r in range(2):
                await core.push(
                    header(r, x, rnd=7), x.tobytes(), _wire.fingerprint(x)
                )
            far = time.monotonic() + 5
            total = await core.pull(header(0, x, rnd=7), deadline=far, raw=True)
            np.testing.assert_array_equal(total, 2 * x)
        finally:
            core.close()

    run(main())


def test_memory_cap_names_itself():
    async def main():
        core = _summation.Summation(1, max_memory=1 << 20)
        join(core)
        try:
            x = np.ones(1 << 18, np.float32)  # 1 MiB: one accumulator fits
            await core.push(
                header(0, x, key=1), x.tobytes(), _wire.fingerprint(x)
            )
            with pytest.raises(_wire.Rejected, match="--max-memory 1 MiB") as e:
                await core.push(
                    header(0, x, key=2), x.tobytes(), _wire.fingerprint(x)
                )
            assert e.value.code == "RESOURCE_EXHAUSTED"
        finally:
            core.close()

    run(main())


def test_pull_answers_at_the_workers_timeout_naming_the_missing_rank():
    async def main():
        core = _summation.Summation(2, round_timeout=60.0)
        join(core, timeout=0.2)
        try:
            x = np.ones(2, np.float32)
            await core.push(header(0, x), x.tobytes(), _wire.fingerprint(x))
            t0 = time.monotonic()
            with pytest.raises(_wire.Rejected, match=r"rank\(s\) \[1\]"):
                await core.pull(header(0, x), deadline=t0 + 30)
            assert time.monotonic() - t0 < 2.0
        finally:
            core.close()

    run(main())


def test_pull_into_a_buffer():
    async def main():
        core = _summation.Summation(1)
        join(core)
        try:
            x = np.arange(3, dtype=np.float32)
            await core.push(header(0, x), x.tobytes(), _wire.fingerprint(x))
            out = bytearray(x.nbytes)
            far = time.monotonic() + 10
            reply = await core.pull(header(0, x), deadline=far, into=out)
            assert reply == core.in_slot_reply(1)
            message = pb.PullReply.FromString(reply)
            assert message.in_slot and message.contributors == 1
            np.testing.assert_array_equal(np.frombuffer(out, np.float32), x)
        finally:
            core.close()

    run(main())


def test_codec_reply_is_the_store_encoding():
    core = _summation.Summation(1)
    try:
        total = np.ones(2, np.float32)
        store = core.jobs.hello("job", 0, "", "w").store
        assert store.encode(total) == _codec.encode_pull_reply(
            core.incarnation, total
        )
    finally:
        core.close()


def test_a_forged_checksum_is_refused_not_taken_for_a_replay():
    async def main():
        core = _summation.Summation(2)
        join(core)
        try:
            x = np.ones(4, np.float32)
            await core.push(header(0, x), x.tobytes(), _wire.fingerprint(x))
            forged = (2 * x).tobytes()  # another payload, the first checksum
            with pytest.raises(_wire.Rejected, match="is not its payload") as e:
                await core.push(header(0, x), forged, _wire.fingerprint(x))
            assert e.value.code == "INVALID_ARGUMENT"
        finally:
            core.close()

    run(main())


def join_header(rank, epoch, job_id="job"):
    h = header(rank, np.zeros(1, np.float32), rnd=epoch, key=0, job_id=job_id)
    h.name = "jaxps.join"
    return h


def test_join_waits_for_every_rank_and_starts_the_next_epoch():
    async def main():
        core = _summation.Summation(3)
        join(core)
        try:
            soon = time.monotonic() + 0.2
            with pytest.raises(_wire.Rejected) as err:
                await core.join(join_header(1, 0), deadline=soon)
            assert err.value.code == "DEADLINE_EXCEEDED"
            assert "waiting for rank(s) [0, 2]" in err.value.message
            far = time.monotonic() + 10
            # rank 1 stays joined: a second join waits along
            waiting = [
                asyncio.ensure_future(
                    core.join(join_header(r, 0), deadline=far)
                )
                for r in (1, 2)
            ]
            await asyncio.sleep(0.05)
            assert not any(w.done() for w in waiting)
            assert await core.join(join_header(0, 0), deadline=far) == 0
            assert [await w for w in waiting] == [0, 0]
            # a retried join of the ended epoch is answered, joins nothing
            assert await core.join(join_header(2, 0), deadline=far) == 0
            with pytest.raises(_wire.Rejected, match="names epoch 2"):
                await core.join(join_header(2, 2), deadline=far)
            # the next epoch: everyone pushes again, from round 0
            x = np.ones(2, np.float32)
            for r in range(3):
                await core.push(header(r, x), x.tobytes(), _wire.fingerprint(x))
            total, n = await core.pull_counted(header(0, x), deadline=far)
            assert n == 3
            assert _codec.decode_pull_reply(total)[3] == 3
        finally:
            core.close()

    run(main())


def test_join_refused_by_async_servers():
    async def main():
        core = _summation.Summation(2, async_mode=True)
        join(core)
        try:
            with pytest.raises(_wire.Rejected, match="synchronous servers"):
                await core.join(join_header(0, 0), deadline=time.monotonic())
        finally:
            core.close()

    run(main())
