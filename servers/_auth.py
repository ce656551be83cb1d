"""Shared-token authentication and TLS credentials of the server."""

from __future__ import annotations

import hmac
import pathlib

import grpc

from ._wire import TOKEN_KEY

_OPEN = ("/grpc.health.v1.Health/",)  # health checks need no token


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the shared token with UNAUTHENTICATED.

    The call is refused before its handler runs, so an unauthenticated push
    never reaches a sum.
    """

    def __init__(self, token: str):
        self._token = token.encode()

        async def deny(request, context):
            del request
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong jaxps token: set the same JAXPS_TOKEN on "
                "workers and --token on servers.",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._token):
                    return await continuation(handler_call_details)
        return self._deny


def server_credentials(
    cert: str, key: str, client_ca: str | None = None
) -> grpc.ServerCredentials:
    """TLS credentials from PEM files; `client_ca` requires client certs."""
    pair = [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(
        pair,
        root_certificates=_read(client_ca, "--tls-client-ca"),
        require_client_auth=True,
    )


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as err:
        raise OSError(f"cannot read {what} file {path!r}: {err}") from None
