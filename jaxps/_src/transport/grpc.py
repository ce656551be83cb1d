"""Payloads in the gRPC messages: a Push, then an asynchronous Pull."""

from __future__ import annotations

import time

import grpc
import numpy as np

from jaxps._src import errors
from jaxps._src.plan import payload
from jaxps._src.transport.base import (
    Chunk,
    Credit,
    Transport,
    fingerprint,
    pull_deadline,
)


class GrpcTransport(Transport):
    """Pushes a chunk's payload in a Push message, which the server
    acknowledges once it has it; the credit goes back then, and a Pull
    whose reply carries the sum is started at once, as a future."""

    def send(self, chunk: Chunk, credit: Credit) -> None:
        self.push_then_pull(
            chunk, credit, self._span("queue", chunk.queued, chunk)
        )

    def push_then_pull(
        self, chunk: Chunk, credit: Credit, pushed: float
    ) -> None:
        """Pushes `chunk`, gives its credit back and pulls its sum
        (`pushed`: when the push began); also the fallback of the other
        transports. The sender thread waits for the pull itself (a blocking
        call costs gRPC Python far less CPU than a future) while
        `credit.may_block()` allows it, else the pull is a future."""
        timeout = self.timeout
        h, source = chunk.header, payload(chunk.source)
        try:
            self.client.push(
                h, source, fingerprint(source), time.monotonic() + timeout
            )
        except errors.JaxpsError as err:
            chunk.handle.fail(err)
            return
        finally:
            credit.release(chunk.nbytes)
        pulling = self._span("push", pushed, chunk)
        deadline = time.monotonic() + pull_deadline(timeout)
        if credit.may_block():
            try:
                self._complete(
                    chunk, pulling, lambda: self._payload(chunk, deadline)
                )
            finally:
                credit.unblock()
            return
        try:
            future = self.client.pull_future(h, deadline)
        except errors.JaxpsError as err:
            chunk.handle.fail(err)
            return
        future.add_done_callback(
            lambda f: self._complete(
                chunk, pulling, lambda: self._receive(chunk, f)
            )
        )

    def _payload(self, chunk: Chunk, deadline: float, reply=None):
        """The sum (and its contributors) of a blocking pull, or of an
        encoded `reply`."""
        h = chunk.header
        if reply is None:
            payload, contributors = self.client.pull_counted(h, deadline)
        else:
            payload, contributors = self.client.decode_pull_counted(reply, h)
        return np.frombuffer(payload, chunk.dest.dtype), contributors

    def _receive(self, chunk: Chunk, future) -> tuple[np.ndarray, int]:
        """The sum in the reply of a pull; a pull that found the server
        unavailable is retried (blocking) until its deadline."""
        try:
            reply = future.result()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise self.client.translate(err, "pull", chunk.header) from None
            deadline = time.monotonic() + pull_deadline(self.timeout)
            return self._payload(chunk, deadline)
        return self._payload(chunk, 0.0, reply)
