"""Shared fixtures: real summation servers in separate processes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from jaxps.servers._wire import READY_PREFIX  # noqa: E402


class ServerProcess:
    """A ``jaxps-server`` child process on 127.0.0.1 and a free port."""

    def __init__(self, num_workers: int, *extra: str):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxps.servers",
                "--port",
                "0",
                "--num-workers",
                str(num_workers),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(
                f"server did not start: {line!r} {self.proc.stderr.read()}"
            )
        self.address = line[len(READY_PREFIX) :].strip()

    def stop(self, sig=None) -> None:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


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
