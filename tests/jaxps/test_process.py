"""Tests of the process helper (`jaxps._src.launch.process`)."""

from __future__ import annotations

import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxps._src.launch import process

PY = sys.executable


def _script(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def _split(data: bytes, size: int) -> list[str]:
    split, lines = process.LineSplitter(), []
    for i in range(0, len(data), size):
        lines += split.feed(data[i : i + size])
    return lines + split.feed(b"", final=True)


def test_lines_end_at_newline_crlf_and_lone_carriage_return():
    data = "a\r\nb\rc\n\rd\r\r\ne\u00e9\n\nlast".encode()
    expected = ["a", "b", "c", "d", "", "e\u00e9", "", "last"]
    for size in range(1, len(data) + 1):
        assert _split(data, size) == expected, size


def test_each_progress_bar_update_is_a_line():
    data = b"\r  0%|    |\r 50%|##  |\r100%|####|\n"
    assert _split(data, 64) == ["  0%|    |", " 50%|##  |", "100%|####|"]


def test_log_files_and_wait_for_line(tmp_path):
    code = """
        import sys
        print("hello", flush=True)
        print("oops", file=sys.stderr, flush=True)
        print("READY 127.0.0.1:5  ", flush=True)
    """
    child = process.Child("c", _script(code), log_dir=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        assert child.wait_for_line("READY ", deadline) == "127.0.0.1:5"
        assert child.wait(deadline) == 0
    finally:
        child.stop()
    assert child.returncode == 0 == child.poll()
    assert child.stdout().splitlines()[0] == "hello"
    assert child.stderr_tail() == "oops\n"
    assert (tmp_path / "c.out").exists() and (tmp_path / "c.err").exists()


def test_on_line_gets_both_streams(tmp_path):
    code = """
        import sys
        sys.stderr.write("\\r1/2\\r2/2\\n")
        print("READY x", flush=True)
    """
    lines = []
    exited = []
    child = process.Child(
        "c",
        _script(code),
        cwd=str(tmp_path),
        on_line=lambda stream, text: lines.append((stream, text)),
        on_exit=exited.append,
    )
    try:
        assert child.wait_for_line("READY", time.monotonic() + 30) == "x"
        child.wait(time.monotonic() + 30)
    finally:
        child.stop()
    assert ("stdout", "READY x") in lines
    assert [t for s, t in lines if s == "stderr"] == ["1/2", "2/2"]
    assert exited == [child]
    assert child.stderr_tail() == "1/2\n2/2\n"


def test_pipe_leaves_the_rest_of_stdout_to_the_caller():
    code = """
        import sys, time
        print("before", flush=True)
        sys.stdout.write("READY a:1\\nafter\\n")
        sys.stdout.flush()
        time.sleep(30)
    """
    child = process.Child("c", _script(code))
    try:
        assert child.wait_for_line("READY ", time.monotonic() + 30) == "a:1"
        assert child.proc.stdout.readline() == "after\n"
    finally:
        child.stop()
    assert child.proc.stdout.closed
    assert child.returncode == -signal.SIGTERM


@pytest.mark.parametrize("mode", ["log_dir", "on_line", "pipe"])
def test_exit_before_the_line_raises_with_the_stderr_tail(tmp_path, mode):
    code = "import sys; print('nope'); sys.exit('boom')"
    kwargs = {
        "log_dir": {"log_dir": str(tmp_path)},
        "on_line": {"on_line": lambda stream, text: None},
        "pipe": {},
    }[mode]
    child = process.Child("c", _script(code), **kwargs)
    try:
        with pytest.raises(process.ChildExited) as exc:
            child.wait_for_line("READY", time.monotonic() + 30)
    finally:
        child.stop()
    assert exc.value.returncode == 1
    assert "c exited with 1 before printing 'READY'" in str(exc.value)
    assert "boom" in str(exc.value)


@pytest.mark.parametrize("mode", ["log_dir", "on_line", "pipe"])
def test_deadline_and_check(tmp_path, mode):
    kwargs = {
        "log_dir": {"log_dir": str(tmp_path)},
        "on_line": {"on_line": lambda stream, text: None},
        "pipe": {},
    }[mode]
    child = process.Child("c", _script("import time; time.sleep(30)"), **kwargs)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not print 'READY'"):
            child.wait_for_line("READY", start + 0.3)
        assert time.monotonic() - start < 5
        calls = []

        def check():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            child.wait_for_line("READY", time.monotonic() + 30, check)
        with pytest.raises(TimeoutError, match="did not finish"):
            child.wait(time.monotonic() + 0.1)
    finally:
        child.stop()


@pytest.mark.parametrize("mode", ["on_line", "pipe"])
def test_closed_stdout(mode):
    code = "import os, time; os.close(1); time.sleep(30)"
    kwargs = {"on_line": lambda stream, text: None} if mode == "on_line" else {}
    child = process.Child("c", _script(code), **kwargs)
    try:
        with pytest.raises(process.StdoutClosed):
            child.wait_for_line("READY", time.monotonic() + 1)
    finally:
        child.stop()


def test_stop_reaches_the_group_and_kills_after_the_grace(tmp_path):
    code = """
        import pathlib, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c",
                                       "import time; time.sleep(60)"])
        pathlib.Path("grandchild").write_text(str(grandchild.pid))
        print("up", flush=True)
        time.sleep(60)
    """
    child = process.Child(
        "c", _script(code), cwd=str(tmp_path), log_dir=str(tmp_path)
    )
    child.wait_for_line("up", time.monotonic() + 30)
    assert (tmp_path / "grandchild").exists()
    start = time.monotonic()
    child.stop(grace=0.5)
    took = time.monotonic() - start
    assert 0.5 <= took < 5, took
    assert child.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while child.group_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.group_alive()  # the grandchild is gone too
    child.stop()  # a second stop does nothing


def test_stop_all_is_cut_short_when_interrupted():
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """
    children = [process.Child(f"c{i}", _script(code)) for i in range(2)]
    time.sleep(0.5)  # let them ignore SIGTERM
    start = time.monotonic()
    assert process.stop_all(children, 30, interrupted=lambda: True) == []
    assert time.monotonic() - start < 10
    assert all(c.returncode == -signal.SIGKILL for c in children)


def test_wait_all_raises_for_the_first_failure(tmp_path):
    ok = process.Child("ok", _script("pass"), log_dir=str(tmp_path))
    bad = process.Child(
        "bad", _script("import sys; sys.exit('no')"), log_dir=str(tmp_path)
    )
    slow = process.Child(
        "slow", _script("import time; time.sleep(30)"), log_dir=str(tmp_path)
    )
    try:
        with pytest.raises(RuntimeError, match="bad exited with 1"):
            process.wait_all([slow, ok, bad], time.monotonic() + 20)
        with pytest.raises(TimeoutError, match="slow did not finish"):
            process.wait_all([slow], time.monotonic() + 0.2)
        process.wait_all([ok], time.monotonic() + 20)
    finally:
        process.stop_all([ok, bad, slow])


def test_missing_program_raises_oserror():
    with pytest.raises(FileNotFoundError):
        process.Child("c", ["./no-such-program"])


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2")
def test_network_namespace_prefix(tmp_path):
    child = process.Child(
        "c", ["true"], netns="jxb-no-such-ns", log_dir=str(tmp_path)
    )
    child.wait(time.monotonic() + 30)
    child.stop()
    assert child.argv == ["ip", "netns", "exec", "jxb-no-such-ns", "true"]
    assert child.returncode != 0


def test_server_address(start_servers):
    (server,) = start_servers(1, 1)
    host, _, port = server.address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0


def test_the_helper_imports_no_jax_or_server():
    source = Path(process.__file__).read_text()
    imports = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imports <= set(sys.stdlib_module_names) | {"__future__"}, imports
