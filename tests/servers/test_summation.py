"""The gRPC-free core of the service, driven as the data channel does."""

import asyncio
import time
import types

import numpy as np
import pytest

from jaxps.servers import _codec, _summation, _wire
from jaxps.servers import jaxps_pb2 as pb


def header(rank, array, rnd=0, key=5, job_id="job", version=None):
    return types.SimpleNamespace(
        version=_wire.PROTOCOL_VERSION if version is None else version,
        job_id=job_id,
        rank=rank,
        key=key,
        round=rnd,
        dtype=_wire.dtype_code(array.dtype),
        length=array.size,
        name="w",
    )


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("async_mode", [False, True])
def test_push_then_pull_raw_and_encoded(async_mode):
    async def main():
        core = _summation.Summation(2, async_mode=async_mode)
        try:
            x = np.arange(6, dtype=np.float32)
            far = time.monotonic() + 10
            for rank in range(2):
                payload = (x * (rank + 1)).tobytes()
                h = header(rank, x)
                await core.push(h, payload, _wire.checksum(payload))
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
        try:
            x = np.ones(4, np.float32)
            far = time.monotonic() + 10
            await core.push(header(0, x), x.tobytes(), 0)
            pull = asyncio.ensure_future(
                core.pull(header(0, x), deadline=far, raw=True)
            )
            await asyncio.sleep(0.05)
            assert not pull.done()  # the round is incomplete
            await core.push(header(1, x), x.tobytes(), 1)
            np.testing.assert_array_equal(await pull, 2 * x)
        finally:
            core.close()

    run(main())


def test_pull_deadline_names_the_missing_ranks():
    async def main():
        core = _summation.Summation(3)
        try:
            x = np.ones(2, np.float32)
            await core.push(header(1, x), x.tobytes(), 0)
            with pytest.raises(_wire.Rejected) as e:
                await core.pull(header(1, x), deadline=time.monotonic() + 0.05)
            assert e.value.code == "DEADLINE_EXCEEDED"
            assert "waiting for rank(s) [0, 2]" in e.value.message
        finally:
            core.close()

    run(main())


def test_header_checks_adopt_the_first_job_id():
    core = _summation.Summation(2)
    try:
        x = np.ones(1, np.float32)
        core.check_header(header(0, x, job_id="a"))
        assert core.job_id == "a"
        with pytest.raises(_wire.Rejected, match="unknown job_id 'b'") as e:
            core.check_header(header(0, x, job_id="b"))
        assert e.value.code == "PERMISSION_DENIED"
        with pytest.raises(_wire.Rejected, match="version mismatch"):
            core.check_header(header(0, x, job_id="a", version=1))
        with pytest.raises(_wire.Rejected, match="rank 2 out of range"):
            core.check_rank(2)
        with pytest.raises(_wire.Rejected, match="wrong num_workers"):
            core.hello(header(0, x, job_id="a"), 3)
    finally:
        core.close()


def test_pull_into_a_buffer():
    async def main():
        core = _summation.Summation(1)
        try:
            x = np.arange(3, dtype=np.float32)
            await core.push(header(0, x), x.tobytes(), 0)
            out = bytearray(x.nbytes)
            far = time.monotonic() + 10
            reply = await core.pull(header(0, x), deadline=far, into=out)
            assert reply == core.in_slot_reply
            assert pb.PullReply.FromString(reply).in_slot
            np.testing.assert_array_equal(np.frombuffer(out, np.float32), x)
        finally:
            core.close()

    run(main())


def test_codec_reply_is_the_store_encoding():
    core = _summation.Summation(1)
    try:
        total = np.ones(2, np.float32)
        assert core.store.encode(total) == _codec.encode_pull_reply(
            core.incarnation, total
        )
    finally:
        core.close()
