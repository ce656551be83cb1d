"""Tests of the ``jaxps-launch`` command (`jaxps._src.launch`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jaxps._src.launch import local as launch

PY = sys.executable


def _env() -> dict[str, str]:
    """The test environment without any JAXPS_* setting."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAXPS_")}


def _launch_argv(*args: str) -> list[str]:
    return [PY, "-m", "jaxps._src.launch", *args]


def _run(tmp_path: Path, *args: str, timeout: float = 60):
    return subprocess.run(
        _launch_argv(*args),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _script(code: str) -> list[str]:
    """A worker command running `code` with the test's Python."""
    return [PY, "-c", textwrap.dedent(code)]


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Lines:
    """Collects the lines of a pipe in a background thread."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self._thread = threading.Thread(
            target=self._read, args=(pipe,), daemon=True
        )
        self._thread.start()

    def _read(self, pipe) -> None:
        with pipe:
            for line in pipe:
                self.lines.append(line.rstrip("\n"))

    def join(self, timeout: float = 10) -> None:
        self._thread.join(timeout)


def _read_pids(tmp_path: Path, pattern: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob(pattern))]


# A worker that records its pid in pid<rank>, says so and sleeps.
_SLEEPER = """
    import os, pathlib, time
    rank = os.environ["JAXPS_WORKER_RANK"]
    pathlib.Path(f"pid{rank}").write_text(str(os.getpid()))
    print("started", rank, flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_workers_get_env_and_prefixed_output(tmp_path):
    code = """
        import os, sys
        e = os.environ
        print("rank", e["JAXPS_WORKER_RANK"], "servers", e["JAXPS_SERVERS"],
              "n", e["JAXPS_NUM_WORKERS"], "job", e["JAXPS_JOB_ID"])
        print("to stderr", e["JAXPS_WORKER_RANK"], file=sys.stderr)
    """
    res = _run(
        tmp_path,
        "--workers",
        "2",
        "--servers",
        "1",
        "--job-id",
        "job7",
        "--",
        *_script(code),
    )
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "] rank " in ln]
    assert len(lines) == 2, res.stdout
    servers = set()
    for rank in (0, 1):
        (line,) = [ln for ln in lines if ln.startswith(f"[worker {rank}] ")]
        words = line.split()
        assert words[3] == str(rank)
        assert words[6:] == ["n", "2", "job", "job7"]
        servers.add(words[5])
        assert f"[worker {rank}] to stderr {rank}" in res.stderr
    (address,) = servers
    host, _, port = address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert f"[server 0] {launch.READY_PREFIX}{address}" in res.stdout


@pytest.mark.timeout(120)
def test_push_pull_across_two_servers(tmp_path):
    code = """
        import jaxps, numpy as np
        jaxps.init()
        x = np.full(1000, jaxps.rank() + 1.0, np.float32)
        y = jaxps.push_pull_numpy("x", x, average=False)
        assert (y == 3).all(), y
        print("ok")
    """
    res = _run(
        tmp_path,
        "--workers",
        "2",
        "--servers",
        "2",
        "--timeout",
        "30",
        "--",
        *_script(code),
        timeout=110,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[worker 0] ok" in res.stdout.splitlines()
    assert "[worker 1] ok" in res.stdout.splitlines()


@pytest.mark.timeout(150)
def test_killed_server_is_restarted_and_the_job_loses_no_step(tmp_path):
    # Rank 0 kills the server (-9) at step 10; --restart-servers starts it
    # again on its port and the workers fail over to it: every sum exact.
    code = """
        import os, signal, jaxps, numpy as np
        jaxps.init()
        launcher = os.getppid()
        for step in range(40):
            x = np.arange(5000, dtype=np.float32) * (jaxps.rank() + 1) + step
            y = jaxps.push_pull_numpy("x", x, average=False)
            want = np.arange(5000, dtype=np.float32) * 3 + 2 * step
            np.testing.assert_array_equal(y, want)
            if step == 10 and jaxps.rank() == 0:
                path = f"/proc/{launcher}/task/{launcher}/children"
                flag = "--round" + "-timeout"  # the servers' (not this code)
                for pid in open(path).read().split():
                    if flag in open(f"/proc/{pid}/cmdline").read():
                        os.kill(int(pid), signal.SIGKILL)
        jaxps.shutdown()
        print("ok")
    """
    res = _run(
        tmp_path,
        "--workers",
        "2",
        "--servers",
        "1",
        "--restart-servers",
        "1",
        "--deterministic",
        "--timeout",
        "30",
        "--",
        *_script(code),
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[worker 0] ok" in res.stdout.splitlines(), res.stdout
    assert "[worker 1] ok" in res.stdout.splitlines(), res.stdout
    assert "server 0 ended (SIGKILL); starting it again on port" in (
        res.stderr
    ), res.stderr


@pytest.mark.timeout(120)
def test_server_processes_are_all_listed_and_sum(tmp_path):
    code = """
        import os, jaxps, numpy as np
        jaxps.init(partition_bytes=4096)
        servers = os.environ["JAXPS_SERVERS"].split(",")
        x = np.full(20_000, jaxps.rank() + 1.0, np.float32)
        y = jaxps.push_pull_numpy("x", x, average=False)
        assert (y == 3).all(), y
        print("ok", len(set(servers)))
    """
    res = _run(
        tmp_path,
        "--workers",
        "2",
        "--servers",
        "2",
        "--server-processes",
        "2",
        "--timeout",
        "30",
        "--",
        *_script(code),
        timeout=110,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[worker 0] ok 4" in res.stdout.splitlines()
    assert "[worker 1] ok 4" in res.stdout.splitlines()
    ready = [ln for ln in res.stdout.splitlines() if launch.READY_PREFIX in ln]
    assert len(ready) == 4, res.stdout


@pytest.mark.timeout(60)
def test_sigint_stops_every_server_process(tmp_path):
    cmd = _launch_argv(
        "--workers",
        "1",
        "--servers",
        "1",
        "--server-processes",
        "2",
        "--",
        *_script(_SLEEPER),
    )
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = _Lines(proc.stdout), _Lines(proc.stderr)
        _wait_for(lambda: "[worker 0] started 0" in out.lines, 40, "the worker")
        children = _children(proc.pid)
        assert len(children) == 2  # The server supervisor and the worker.
        grandchildren = [g for c in children for g in _children(c)]
        assert len(grandchildren) == 2  # The two server processes.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.join()
    err.join()
    pids = children + grandchildren
    _wait_for(
        lambda: not [p for p in pids if _running(p)], 10, "all to be gone"
    )


def test_dry_run_passes_server_processes(capsys):
    rc = launch.main(
        [
            "--workers",
            "1",
            "--servers",
            "2",
            "--server-processes",
            "3",
            "--dry-run",
            "--",
            "true",
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    servers = [ln for ln in lines if ln.startswith("server ")]
    assert len(servers) == 2
    assert all("--processes 3" in ln for ln in servers), lines


@pytest.mark.timeout(60)
def test_first_failure_stops_the_rest(tmp_path):
    # Rank 1 sleeps (and so does a grandchild of its); rank 0 waits until
    # rank 1 is up, then fails with exit code 3.
    code = """
        import os, pathlib, subprocess, sys, time
        rank = int(os.environ["JAXPS_WORKER_RANK"])
        if rank == 0:
            deadline = time.monotonic() + 40
            while not pathlib.Path("grandchild").exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sys.exit(3)
        pathlib.Path("pid1").write_text(str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c",
                                  "import time; time.sleep(60)"])
        pathlib.Path("grandchild").write_text(str(child.pid))
        time.sleep(60)
    """
    start = time.monotonic()
    res = _run(
        tmp_path, "--workers", "2", "--servers", "1", "--", *_script(code)
    )
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert elapsed < 20
    assert "worker 0 failed (exit code 3)" in res.stderr
    pids = _read_pids(tmp_path, "pid1") + _read_pids(tmp_path, "grandchild")
    assert len(pids) == 2
    _wait_for(
        lambda: not any(_running(p) for p in pids),
        5,
        "the sleeping worker and its child to be gone",
    )


@pytest.mark.timeout(60)
def test_sigint_stops_everything(tmp_path):
    cmd = _launch_argv(
        "--workers", "2", "--servers", "1", "--", *_script(_SLEEPER)
    )
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = _Lines(proc.stdout), _Lines(proc.stderr)
        _wait_for(
            lambda: (
                {"[worker 0] started 0", "[worker 1] started 1"}
                <= set(out.lines)
            ),
            40,
            "both workers to start",
        )
        children = _children(proc.pid)
        assert len(children) == 3  # One server and two workers.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.join()
    err.join()
    assert "jaxps-launch: got SIGINT; stopping all processes" in err.lines
    pids = children + _read_pids(tmp_path, "pid*")
    assert not [p for p in pids if _running(p)]


@pytest.mark.timeout(60)
def test_sigterm_kills_a_worker_that_ignores_it(tmp_path):
    code = textwrap.dedent("""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """) + textwrap.dedent(_SLEEPER)
    cmd = _launch_argv("--workers", "1", "--servers", "0", "--", *_script(code))
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = _Lines(proc.stdout), _Lines(proc.stderr)
        _wait_for(
            lambda: "[worker 0] started 0" in out.lines,
            30,
            "the worker to start",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=launch.STOP_GRACE + 10) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.join()
    err.join()
    assert "jaxps-launch: got SIGTERM; stopping all processes" in err.lines
    (pid,) = _read_pids(tmp_path, "pid0")
    assert not _running(pid)


@pytest.mark.timeout(30)
def test_single_worker_without_servers(capsys):
    code = """
        import os
        e = os.environ
        print(repr(e["JAXPS_SERVERS"]), e["JAXPS_TIMEOUT"],
              e["JAXPS_JOB_ID"].startswith("jaxps-"))
    """
    rc = launch.main(
        [
            "--workers",
            "1",
            "--servers",
            "0",
            "--timeout",
            "7",
            "--",
            *_script(code),
        ]
    )
    assert rc == 0
    assert "[worker 0] '' 7.0 True" in capsys.readouterr().out.splitlines()


@pytest.mark.timeout(30)
def test_carriage_return_updates_are_prefixed_one_by_one(capsys):
    # A progress bar (tqdm) redraws its line with "\r": every update must
    # come out as a prefixed line of its own, not one mangled line.
    code = """
        import sys, time
        for i in range(3):
            sys.stderr.write(f"\\r{50 * i:3d}%|bar")
            sys.stderr.flush()
            time.sleep(0.05)
        sys.stderr.write("\\n")
        print("done\\r\\nnext", flush=True)
    """
    rc = launch.main(["--workers", "1", "--servers", "0", "--", *_script(code)])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [ln for ln in err.splitlines() if "bar" in ln] == [
        "[worker 0]   0%|bar",
        "[worker 0]  50%|bar",
        "[worker 0] 100%|bar",
    ]
    assert out.splitlines() == ["[worker 0] done", "[worker 0] next"]


def test_usage_line_names_every_option():
    parser = launch._parser()
    usage = parser.format_usage()
    for action in parser._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        assert action.option_strings[-1] in usage, action.option_strings


@pytest.mark.timeout(30)
def test_worker_killed_by_signal(capsys):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    rc = launch.main(["--workers", "1", "--servers", "0", "--", *_script(code)])
    assert rc == 128 + signal.SIGKILL
    assert "worker 0 failed (SIGKILL)" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_missing_program(capsys):
    rc = launch.main(
        ["--workers", "1", "--servers", "0", "--", "./no-such-program"]
    )
    assert rc == 127
    assert "cannot start worker 0" in capsys.readouterr().err


def _fake_server(monkeypatch, code: str) -> None:
    monkeypatch.setattr(
        launch.Launcher, "_server_argv", lambda self: _script(code)
    )


@pytest.mark.timeout(30)
def test_server_that_dies_before_ready(monkeypatch, capsys):
    _fake_server(monkeypatch, "import sys; sys.exit('boom')")
    rc = launch.main(
        ["--workers", "1", "--servers", "1", "--", PY, "-c", "print('never')"]
    )
    assert rc == 1
    out, err = capsys.readouterr()
    assert "[server 0] boom" in err
    assert "server 0 ended (exit code 1) before it was ready" in err
    assert "never" not in out


@pytest.mark.timeout(30)
def test_server_that_never_gets_ready(monkeypatch, capsys):
    monkeypatch.setattr(launch, "SERVER_START_TIMEOUT", 1.0)
    _fake_server(monkeypatch, "import time; time.sleep(60)")
    start = time.monotonic()
    rc = launch.main(
        ["--workers", "1", "--servers", "1", "--", PY, "-c", "print('never')"]
    )
    assert rc == 1
    assert time.monotonic() - start < 15
    assert "server 0 printed no" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_server_that_dies_while_workers_run(monkeypatch, capsys, tmp_path):
    _fake_server(
        monkeypatch,
        f"""
        import time
        print({launch.READY_PREFIX!r} + "127.0.0.1:1", flush=True)
        time.sleep(1)
    """,
    )
    pid_file = tmp_path / "pid"
    sleeper = f"""
        import os, pathlib, time
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """
    start = time.monotonic()
    rc = launch.main(
        ["--workers", "1", "--servers", "1", "--", *_script(sleeper)]
    )
    assert rc == 1
    assert time.monotonic() - start < 15
    assert "server 0 ended (exit code 0) while workers were running" in (
        capsys.readouterr().err
    )
    assert not _running(int(pid_file.read_text()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0", "--servers", "1", "--", "true"], "--workers"),
        (["--workers", "1", "--servers", "-1", "--", "true"], "--servers"),
        (["--workers", "2", "--servers", "0", "--", "true"], "--servers 0"),
        (["--workers", "1", "--servers", "1"], "command is required"),
        (["--workers", "1", "--servers", "1", "--"], "command is required"),
        (["--servers", "1", "--", "true"], "--workers"),
        (["--workers", "2", "--", "true"], "--servers is required for 2"),
        (
            ["-w", "1", "-s", "1", "--server-processes", "0", "--", "true"],
            "--server-processes must be >= 1, got 0",
        ),
        (
            ["-w", "1", "-s", "1", "--restart-servers", "-1", "--", "true"],
            "--restart-servers must be >= 0, got -1",
        ),
        (
            [
                "--workers",
                "1",
                "--servers",
                "1",
                "--timeout",
                "0",
                "--",
                "true",
            ],
            "--timeout",
        ),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "jaxps-launch: error:" in err
    assert message in err


def test_one_worker_needs_no_servers_flag():
    config = launch.parse_args(["--workers", "1", "--", "true"])
    assert config.servers == 0 and config.workers == 1


@pytest.mark.timeout(30)
def test_bad_arguments_exit_code_of_the_command(tmp_path):
    res = _run(tmp_path, "--workers", "2", "--servers", "0", "--", "true")
    assert res.returncode == 2
    assert "--servers 0 works only with --workers 1" in res.stderr


def test_command_keeps_its_own_options_and_double_dash():
    config = launch.parse_args(
        [
            "--workers",
            "1",
            "--servers",
            "0",
            "--",
            "prog",
            "--workers",
            "5",
            "--",
            "x",
        ]
    )
    assert config.command == ("prog", "--workers", "5", "--", "x")
    config = launch.parse_args(
        ["--workers", "1", "--servers", "0", "prog", "--flag", "--", "x"]
    )
    assert config.command == ("prog", "--flag", "--", "x")


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXPS_TIMEOUT", "12.5")
    config = launch.parse_args(
        ["--workers", "1", "--servers", "0", "--", "prog"]
    )
    assert config.timeout == 12.5
    assert "JAXPS_TIMEOUT" not in config.worker_env
    config = launch.parse_args(
        ["--workers", "1", "--servers", "0", "--timeout", "3", "--", "prog"]
    )
    assert config.timeout == 3.0
    assert config.worker_env["JAXPS_TIMEOUT"] == "3.0"


@pytest.mark.timeout(60)
def test_devices_per_worker_gives_each_worker_its_own_gpus(capsys):
    code = """
        import os
        print("sees", os.environ["CUDA_VISIBLE_DEVICES"])
    """
    rc = launch.main(
        [
            "--workers",
            "2",
            "--servers",
            "1",
            "--devices-per-worker",
            "2",
            "--",
            *_script(code),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert "[worker 0] sees 0,1" in out
    assert "[worker 1] sees 2,3" in out
    assert "jaxps-launch: worker 1: CUDA_VISIBLE_DEVICES=2,3" in out


def test_devices_per_worker_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        launch.main(["-w", "1", "--devices-per-worker", "0", "--", "true"])
    assert "--devices-per-worker must be >= 1, got 0" in capsys.readouterr().err
