"""The elastic membership a server agrees (`_rendezvous`) and the elastic
job incarnations it then serves (`_summation.hello` with a generation)."""

import asyncio
import time

import numpy as np
import pytest

from jaxps.servers import _rendezvous, _summation, _wire
from jaxps.servers import jaxps_pb2 as pb


def arrive(r, member, was=0, expected=0, settle=0.0, hint=0, wait=5.0):
    return r.arrive(
        member,
        was,
        expected=expected,
        settle=settle,
        hint=hint,
        deadline=time.monotonic() + wait,
    )


def running(value=True):
    return lambda: value


async def running_job_of(*members):
    """A rendezvous whose first generation are `members`, running."""
    r = _rendezvous.Rendezvous("j", running(True))
    n = len(members)
    await asyncio.gather(*(arrive(r, m, expected=n) for m in members))
    return r


def test_first_generation_closes_when_all_arrive_in_hint_order():
    async def main():
        r = _rendezvous.Rendezvous("j", running(False))
        got = await asyncio.gather(
            arrive(r, "c", expected=3, hint=2),
            arrive(r, "a", expected=3, hint=0),
            arrive(r, "b", expected=3, hint=1),
        )
        assert got == [(1, ("a", "b", "c"))] * 3
        assert r.waiting == 0

    asyncio.run(main())


def test_survivors_close_after_settle_and_keep_their_order():
    async def main():
        r = _rendezvous.Rendezvous("j", running(False))
        await asyncio.gather(
            *(arrive(r, m, expected=3, hint=i) for i, m in enumerate("abc"))
        )
        began = time.monotonic()
        got = await asyncio.gather(
            arrive(r, "c", was=1, expected=3, settle=0.3),
            arrive(r, "a", was=1, expected=3, settle=0.3),
        )
        assert got == [(2, ("a", "c"))] * 2  # "b" is lost
        assert 0.3 <= time.monotonic() - began < 2.0

    asyncio.run(main())


def test_a_newcomer_waits_for_the_running_job_then_joins_last():
    async def main():
        r = await running_job_of("a", "b")
        # a newcomer's own count (or settle) never starts a generation
        joiner = asyncio.ensure_future(
            arrive(r, "new", expected=1, settle=0.05, hint=0)
        )
        await asyncio.sleep(0.3)
        assert not joiner.done() and r.waiting == 1
        # rank 0 saw it (a probe) and the members re-form with it
        got = await asyncio.gather(
            arrive(r, "b", was=1, expected=3), arrive(r, "a", was=1, expected=3)
        )
        assert got == [(2, ("a", "b", "new"))] * 2
        assert await joiner == (2, ("a", "b", "new"))

    asyncio.run(main())


def test_newcomers_start_afresh_once_the_job_stopped():
    async def main():
        state = {"running": True}
        r = _rendezvous.Rendezvous("j", lambda: state["running"])
        await arrive(r, "a", expected=1)
        # the next run of the job, on servers that outlived the first
        second = asyncio.ensure_future(arrive(r, "x", expected=1))
        await asyncio.sleep(0.2)
        assert not second.done()
        state["running"] = False
        assert await asyncio.wait_for(second, 3.0) == (2, ("x",))

    asyncio.run(main())


def test_a_retry_gets_its_generation_and_bad_arrivals_are_named():
    async def main():
        r = await running_job_of("a", "b")
        assert await arrive(r, "a", was=0) == (1, ("a", "b"))  # lost reply
        with pytest.raises(_wire.Rejected, match="generation 7") as e:
            await arrive(r, "a", was=7)
        assert e.value.code == "FAILED_PRECONDITION"
        # a restarted server adopts the generation its members name
        fresh = _rendezvous.Rendezvous("j", running(True))
        got = await asyncio.gather(
            arrive(fresh, "b", was=4, settle=0.1, hint=1),
            arrive(fresh, "a", was=4, settle=0.1, hint=0),
        )
        assert got == [(5, ("a", "b"))] * 2
        with pytest.raises(_wire.Rejected, match="names no member"):
            await arrive(r, "")
        with pytest.raises(_wire.Rejected, match="1 worker.*arrived") as e:
            await arrive(r, "late", wait=0.2)
        assert e.value.code == "DEADLINE_EXCEEDED"
        assert "running generation" in e.value.message
        assert r.waiting == 0  # the one that gave up is gone

    asyncio.run(main())


def header(rank, session="", job_id="job"):
    return pb.Header(
        version=_wire.PROTOCOL_VERSION,
        job_id=job_id,
        rank=rank,
        session=session,
    )


def test_an_elastic_session_has_its_own_size():
    core = _summation.Summation(4)  # --num-workers 4
    try:
        s = core.hello(header(0), 2, init_id="a", generation=1)
        assert s.num_workers == 2 and s.generation == 1
        assert core.hello(header(1), 2, init_id="b", generation=1) is s
        with pytest.raises(_wire.Rejected, match="rank 2 out of range"):
            core.hello(header(2), 2, init_id="c", generation=1)
        # the next generation is a new incarnation: no rounds are shared
        s3 = core.hello(header(0), 3, init_id="d", generation=2)
        assert s3 is not s and s3.num_workers == 3
        with pytest.raises(_wire.Rejected, match="num_workers=2 generation 2"):
            core.hello(header(1), 2, init_id="e", generation=2)
        with pytest.raises(_wire.Rejected, match="generation 1 .* is newer"):
            core.hello(header(1), 2, init_id="f", generation=1)
        with pytest.raises(_wire.Rejected, match="wrong num_workers"):
            core.hello(header(0), 2, init_id="g")  # not elastic: must be 4
        x = np.ones(3, np.float32)
        h = header(0, s3.id)
        h.key, h.dtype, h.length, h.name = 1, _wire.dtype_code(x.dtype), 3, "x"
        core.check_header(h)
        h.rank = 3
        with pytest.raises(_wire.Rejected, match="rank 3 out of range"):
            core.check_header(h)
    finally:
        core.close()


def test_async_servers_refuse_elastic_workers():
    core = _summation.Summation(2, async_mode=True)
    try:
        with pytest.raises(_wire.Rejected, match="elastic workers need"):
            core.hello(header(0), 2, init_id="a", generation=1)
    finally:
        core.close()


def test_a_probe_with_an_endless_timeout_is_refused():
    async def main():
        core = _summation.Summation(2)
        try:
            request = pb.RendezvousRequest(
                version=_wire.PROTOCOL_VERSION,
                job_id="job",
                probe=True,
                timeout=float("inf"),
            )
            with pytest.raises(_wire.Rejected, match="timeout must be"):
                await core.rendezvous(request, deadline=time.monotonic() + 1)
            request.timeout = 1.0
            assert await core.rendezvous(
                request, deadline=time.monotonic() + 1
            ) == (0, (), 0)
        finally:
            core.close()

    asyncio.run(main())
