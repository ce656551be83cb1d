"""Child processes in a session of their own: start, read, stop.

The one process wrapper of the launcher, the benchmarks and the tests.
A `Child` runs in its own session, so that a signal to its process group
reaches it with every thread and process it started, and `stop` can always
end all of them: SIGTERM to the group, then SIGKILL after a grace period.

Its output goes one of three ways:

- ``log_dir``: stdout and stderr go to ``<log_dir>/<name>.out`` and
  ``.err``; a child can never block on a full pipe.
- ``on_line``: both are pipes that threads read; ``on_line(stream, text)``
  gets every line (``stream`` is ``"stdout"`` or ``"stderr"``). Lines end
  at ``\\n``, ``\\r\\n`` or a lone ``\\r``, so that each update of a
  progress bar is a line of its own.
- neither: stdout is a text pipe that the caller reads (``child.proc.stdout``);
  stderr is read by a thread that keeps its last lines.

This module uses the standard library only: the launcher and the
benchmarks' parents import it without JAX or the server.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO

#: Seconds between SIGTERM and SIGKILL in `Child.stop`.
STOP_GRACE = 5.0
#: Seconds to wait for the output of an exited child to be read.
DRAIN_TIMEOUT = 2.0
#: Lines of stderr kept for error messages when stderr is a pipe.
TAIL_LINES = 20
#: Lines of stdout kept for `Child.wait_for_line` when ``on_line`` is given.
KEPT_LINES = 1000
#: How often the waits look at the child and call their ``check``.
_TICK = 0.05
_CHUNK = 65536

#: ``on_line(stream, text)``: a line a child printed; stream is "stdout" or
#: "stderr".
LineCallback = Callable[[str, str], None]


class ChildExited(RuntimeError):
    """The child ended before it printed the line waited for.

    Attributes:
      returncode: its return code (negative: killed by that signal).
    """

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


class StdoutClosed(TimeoutError):
    """The child closed its stdout without the line and still ran at the
    deadline."""


class LineSplitter:
    """Cuts a byte stream into lines at ``\\n``, ``\\r\\n`` or a lone ``\\r``.

    A lone ``\\r`` is how progress bars (tqdm) redraw a line: each update
    becomes a line of its own, and the empty piece before a bar's first
    ``\\r`` is dropped. Bytes are decoded as UTF-8, bad ones replaced.
    """

    _EOL = re.compile(r"([^\r\n]*)(\r\n|\r|\n)")

    def __init__(self):
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._rest = ""
        self._cr = False  # the text so far ended at a lone "\r"
        self._cr_empty = False  # ... that ended an empty piece

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        """Returns the lines that `data` completes (all of them if final)."""
        text = self._decode(data, final)
        lines: list[str] = []
        if self._cr and text:
            if text[0] == "\n":  # the second half of a "\r\n"
                text = text[1:]
                if self._cr_empty:
                    lines.append("")
            self._cr = False
        text = self._rest + text
        end = 0
        for match in self._EOL.finditer(text):
            line, eol = match.groups()
            end = match.end()
            if eol == "\r" and end == len(text):
                self._cr, self._cr_empty = True, not line
            if line or eol != "\r":
                lines.append(line)
        self._rest = text[end:]
        if final and self._rest:
            lines.append(self._rest)
            self._rest = ""
        return lines


class Child:
    """A child process in its own session (process group).

    Args:
      name: names the child in messages and its log files.
      argv: the command line.
      env: its complete environment (default: this process's).
      cwd: its working directory (default: this process's).
      netns: a network namespace to run it in (``ip netns exec NETNS``).
      log_dir: write stdout and stderr to ``<log_dir>/<name>.out`` and
        ``.err``.
      on_line: instead, call ``on_line(stream, text)`` with each line, from
        a reader thread per stream. It must not raise.
      on_exit: called with the child, from a waiter thread, once it exited.

    Raises:
      OSError: when the command cannot be started.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        netns: str | None = None,
        log_dir: str | None = None,
        on_line: LineCallback | None = None,
        on_exit: Callable[[Child], None] | None = None,
    ):
        if log_dir is not None and on_line is not None:
            raise ValueError("give log_dir or on_line, not both")
        self.name = name
        self.argv = list(argv)
        if netns is not None:
            self.argv = ["ip", "netns", "exec", netns, *self.argv]
        self.out_path = self.err_path = None
        self._on_line = on_line
        self._cond = threading.Condition()
        self._kept: list[str] = []  # stdout lines, with on_line
        self._tail: collections.deque[str] = collections.deque(
            maxlen=TAIL_LINES
        )
        self._stdout_closed = False
        self._exited = threading.Event()
        self._stopped = False
        popen = dict(
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        if log_dir is not None:
            self.out_path = os.path.join(log_dir, f"{name}.out")
            self.err_path = os.path.join(log_dir, f"{name}.err")
            with (
                open(self.out_path, "wb") as out,
                open(self.err_path, "wb") as err,
            ):
                self.proc = subprocess.Popen(
                    self.argv, stdout=out, stderr=err, **popen
                )
            readers = []
        elif on_line is not None:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                **popen,
            )
            readers = [
                (self.proc.stdout, "stdout"),
                (self.proc.stderr, "stderr"),
            ]
        else:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                encoding="utf-8",
                errors="replace",
                **popen,
            )
            readers = [(self.proc.stderr.buffer, "stderr")]
        self._readers = [
            _start_thread(self._read, pipe, stream) for pipe, stream in readers
        ]
        self._waiter = _start_thread(self._wait, on_exit)

    def __repr__(self) -> str:
        return f"<Child {self.name} pid {self.proc.pid}>"

    # -- the threads ---------------------------------------------------------

    def _read(self, pipe: IO[bytes], stream: str) -> None:
        split = LineSplitter()
        with pipe:
            while True:
                try:
                    data = pipe.read1(_CHUNK)
                except (OSError, ValueError):
                    data = b""
                for text in split.feed(data, final=not data):
                    self._line(stream, text)
                if not data:
                    break
        if stream == "stdout":
            with self._cond:
                self._stdout_closed = True
                self._cond.notify_all()

    def _line(self, stream: str, text: str) -> None:
        if self._on_line is not None:
            self._on_line(stream, text)
        if stream == "stderr":
            self._tail.append(text)
            return
        with self._cond:
            if len(self._kept) < KEPT_LINES:
                self._kept.append(text)
            self._cond.notify_all()

    def _wait(self, on_exit: Callable[[Child], None] | None) -> None:
        self.proc.wait()
        self._exited.set()
        if on_exit is not None:
            on_exit(self)

    # -- state -----------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """The return code once the child exited (negative for a signal),
        else None."""
        return self.proc.returncode if self._exited.is_set() else None

    def poll(self) -> int | None:
        """`returncode`: None while the child runs."""
        return self.returncode

    def wait(self, deadline: float | None = None) -> int:
        """Waits for the exit until `deadline` (`time.monotonic`); returns
        the return code, or raises TimeoutError with the stderr tail."""
        timeout = None if deadline is None else deadline - time.monotonic()
        if not self._exited.wait(None if timeout is None else max(0, timeout)):
            raise TimeoutError(
                f"{self.name} did not finish in time:\n{self.stderr_tail()}"
            )
        return self.proc.returncode

    def signal_group(self, signum: int) -> None:
        """Sends `signum` to the child's process group, if any is left."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def group_alive(self) -> bool:
        """Whether the child or anything in its process group still runs."""
        if not self._exited.is_set():
            return True
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    # -- output ----------------------------------------------------------------

    def stdout(self) -> str:
        """Everything the child printed on stdout so far (``log_dir`` only)."""
        if self.out_path is None:
            raise ValueError(f"{self.name}: stdout is not in a log file")
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines the child printed on stderr."""
        if self.err_path is not None:
            with open(self.err_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        kept = list(self._tail)[-lines:]
        return "".join(line + "\n" for line in kept)

    def wait_for_line(
        self,
        prefix: str,
        deadline: float,
        check: Callable[[], None] | None = None,
    ) -> str:
        """Waits for a stdout line starting with `prefix`.

        With ``log_dir`` it looks at all the child printed; with ``on_line``
        at its first `KEPT_LINES` lines; with neither it reads the pipe up
        to the end of that line, leaving the rest to the caller.

        Args:
          prefix: what the line starts with.
          deadline: until when to wait (`time.monotonic`).
          check: called on every look (each 50 ms); may raise to give up.

        Returns:
          The rest of the line, stripped.

        Raises:
          ChildExited: the child ended first (with the stderr tail).
          StdoutClosed: it closed its stdout and still runs at `deadline`.
          TimeoutError: no such line by `deadline` (with the stderr tail).
        """
        return Child.wait_for_lines(self, prefix, 1, deadline, check)[0]

    def wait_for_lines(
        self,
        prefix: str,
        count: int,
        deadline: float,
        check: Callable[[], None] | None = None,
    ) -> list[str]:
        """Waits for `count` stdout lines starting with `prefix`.

        As `wait_for_line`, which is ``count=1``; returns the rest of each
        line, stripped, in the order printed.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got count={count}")
        read = self._lines_reader()
        found: list[str] = []
        while True:
            if check is not None:
                check()
            left = deadline - time.monotonic()
            if left <= 0:
                got = f" ({len(found)} of {count} lines)" if count > 1 else ""
                raise TimeoutError(
                    f"{self.name} did not print {prefix!r} in time{got}:\n"
                    f"{self.stderr_tail()}"
                )
            lines, ended = read(min(left, _TICK))
            for line in lines:
                if line.startswith(prefix):
                    found.append(line[len(prefix) :].strip())
                    if len(found) == count:
                        return found
            if ended:
                break
        if not self._exited.wait(max(0.0, deadline - time.monotonic())):
            raise StdoutClosed(
                f"{self.name} closed its stdout without printing {prefix!r}"
            )
        self._join(time.monotonic() + DRAIN_TIMEOUT)
        raise ChildExited(
            f"{self.name} exited with {self.proc.returncode} before "
            f"printing {prefix!r}:\n{self.stderr_tail()}",
            self.proc.returncode,
        )

    def _lines_reader(self) -> Callable[[float], tuple[list[str], bool]]:
        """``read(timeout) -> (new stdout lines, whether stdout ended)``."""
        if self.out_path is not None:
            return self._file_reader()
        if self._on_line is not None:
            return self._kept_reader()
        return self._pipe_reader()

    def _file_reader(self) -> Callable[[float], tuple[list[str], bool]]:
        split, offset = LineSplitter(), 0

        def read(timeout: float) -> tuple[list[str], bool]:
            nonlocal offset
            ended = self._exited.is_set()  # before reading: nothing is lost
            with open(self.out_path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            lines = split.feed(data, final=ended)
            if not lines and not ended:
                time.sleep(timeout)
            return lines, ended

        return read

    def _kept_reader(self) -> Callable[[float], tuple[list[str], bool]]:
        seen = 0

        def read(timeout: float) -> tuple[list[str], bool]:
            nonlocal seen
            with self._cond:
                if seen == len(self._kept) and not self._stdout_closed:
                    self._cond.wait(timeout)
                lines = self._kept[seen:]
                seen = len(self._kept)
                return lines, self._stdout_closed

        return read

    def _pipe_reader(self) -> Callable[[float], tuple[list[str], bool]]:
        # One byte at a time: what follows the line stays in the pipe.
        fd, line = self.proc.stdout.fileno(), bytearray()

        def read(timeout: float) -> tuple[list[str], bool]:
            end = time.monotonic() + timeout
            while select.select([fd], [], [], max(0, end - time.monotonic()))[
                0
            ]:
                byte = os.read(fd, 1)
                if byte:
                    line.extend(byte)
                if not byte or byte == b"\n":
                    lines = LineSplitter().feed(bytes(line), final=True)
                    line.clear()
                    return lines, not byte
            return [], False

        return read

    # -- stopping --------------------------------------------------------------

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM to the process group, SIGKILL after `grace` s; reaps the
        child and closes its pipes. Does nothing once it has run."""
        stop_all([self], grace)

    def _join(self, deadline: float) -> None:
        """Waits until `deadline` for the reader and waiter threads."""
        for thread in [*self._readers, self._waiter]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _close(self) -> None:
        # Pipes of the reader threads are theirs to close.
        if self.out_path is None and self._on_line is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdout.close()


def stop_all(
    children: Iterable[Child],
    grace: float = STOP_GRACE,
    interrupted: Callable[[], bool] | None = None,
) -> list[Child]:
    """Stops `children` together, as `Child.stop` does one.

    SIGTERM to every process group; once all are gone, after `grace` s or as
    soon as ``interrupted()`` is true, SIGKILL to those left. Then reaps
    every child (waiting up to `grace` s more) and reads the rest of its
    output (up to `DRAIN_TIMEOUT` s). Children stopped before are skipped.

    Returns:
      The children still running after SIGKILL, if any.
    """
    children = [c for c in children if not c._stopped]
    for child in children:
        child._stopped = True
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (
        any(c.group_alive() for c in children)
        and time.monotonic() < deadline
        and not (interrupted is not None and interrupted())
    ):
        time.sleep(0.02)
    for child in children:
        if child.group_alive():
            child.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + grace
    survivors = [
        c
        for c in children
        if not c._exited.wait(max(0.0, deadline - time.monotonic()))
    ]
    deadline = time.monotonic() + DRAIN_TIMEOUT
    for child in children:
        child._join(deadline)
        child._close()
    return survivors


def wait_all(children: Sequence[Child], deadline: float) -> None:
    """Waits for every child to exit 0 by `deadline` (`time.monotonic`).

    Raises as soon as one exits non-zero (the first to fail is usually the
    cause; the others would only wait for it), or at the deadline; the
    message has the stderr tail of that child.
    """
    running = list(children)
    while running:
        for child in list(running):
            code = child.returncode
            if code is None:
                continue
            running.remove(child)
            if code != 0:
                raise RuntimeError(
                    f"{child.name} exited with {code}:\n{child.stderr_tail()}"
                )
        if running and time.monotonic() > deadline:
            names = ", ".join(c.name for c in running)
            raise TimeoutError(
                f"{names} did not finish in time:\n{running[0].stderr_tail()}"
            )
        time.sleep(_TICK)


def server_argv(
    num_workers: int,
    *flags: str,
    host: str | None = None,
    port: int | str | None = None,
) -> list[str]:
    """The command line of a jaxps server (``python -m jaxps.servers``).

    Args:
      num_workers: ``--num-workers``.
      flags: more ``jaxps-server`` flags.
      host: ``--host`` (None: the server's default, 127.0.0.1).
      port: ``--port`` (None: the server's default, a free port).
    """
    argv = [sys.executable, "-m", "jaxps.servers"]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    return argv + ["--num-workers", str(num_workers), *flags]


def server_address(
    child: Child, deadline: float, check: Callable[[], None] | None = None
) -> str:
    """Waits for a jaxps server's ready line; returns its ``HOST:PORT``.

    Args:
      child: a ``jaxps-server`` (``python -m jaxps.servers``).
      deadline: until when to wait (`time.monotonic`).
      check: called on every look; may raise to give up.

    Raises:
      ChildExited, StdoutClosed, TimeoutError: as `Child.wait_for_line`.
    """
    return server_addresses(child, 1, deadline, check)[0]


def server_addresses(
    child: Child,
    count: int,
    deadline: float,
    check: Callable[[], None] | None = None,
) -> list[str]:
    """Waits for `count` ready lines of ``jaxps-server --processes count``;
    returns their ``HOST:PORT`` in the order printed.

    Raises:
      ChildExited, StdoutClosed, TimeoutError: as `Child.wait_for_line`.
    """
    from jaxps.servers._wire import READY_PREFIX  # the wire contract

    # Child's own method: a subclass may take a timeout instead.
    return Child.wait_for_lines(child, READY_PREFIX, count, deadline, check)


def _start_thread(target: Callable[..., None], *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread
