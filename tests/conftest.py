"""Shared fixtures: real summation servers in separate processes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from jaxps._src.launch import process  # noqa: E402

#: Seconds a server may take to print its ready line.
SERVER_START_TIMEOUT = 60.0


class ServerProcess:
    """A ``jaxps-server`` child process on 127.0.0.1 and a free port.

    Its stdout stays a pipe that a test may read (``proc.stdout``) after the
    ready line.
    """

    def __init__(self, num_workers: int, *extra: str):
        self.child = process.Child(
            "jaxps-server",
            process.server_argv(num_workers, *extra, port=0),
        )
        self.proc = self.child.proc
        try:
            self.address = process.server_address(
                self.child, time.monotonic() + SERVER_START_TIMEOUT
            )
        except (RuntimeError, TimeoutError) as err:
            self.stop()
            raise RuntimeError(f"server did not start: {err}") from None

    def stop(self, sig=None) -> None:
        """Sends `sig` (default SIGTERM), then SIGKILL after 10 s."""
        if sig is not None:
            self.child.signal_group(sig)
        self.child.stop(10)


@pytest.fixture
def start_servers():
    """Returns ``start(k, num_workers, *flags) -> [ServerProcess]``."""
    started = []

    def start(k: int, num_workers: int, *extra: str):
        servers = [ServerProcess(num_workers, *extra) for _ in range(k)]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def module_server():
    """One 2-worker server shared by a module's tests."""
    server = ServerProcess(2)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory):
    """A self-signed (cert, key) for localhost and 127.0.0.1: the servers'
    certificate, the CA that signs it, and a client certificate."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)
