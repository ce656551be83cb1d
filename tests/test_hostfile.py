"""Multi-host launch from a hostfile: parsing, ssh command lines, and a run
through a stand-in ``ssh`` that executes the remote command on this host."""

import os
import shlex
import socket
import subprocess
import sys

import pytest

from jaxps._src.launch import hostfile

GOOD = """
# CPU machines
server cpu1:9100
server cpu2      # default port
worker gpu1
worker gpu2
"""


def test_parse():
    hosts = hostfile.parse_hostfile(GOOD)
    assert hosts.servers == ("cpu1:9100", "cpu2:9000")
    assert hosts.workers == ("gpu1", "gpu2")


@pytest.mark.parametrize(
    "text, message",
    [
        ("worker a\nclient b\n", "hostfile:2: expected 'server HOST"),
        ("server a:99999\nworker b\n", "hostfile:1: bad server 'a:99999'"),
        ("server a\n", "no 'worker HOST' line"),
        ("server a\nserver a:9000\nworker b\n", "listed twice"),
    ],
)
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(hostfile.HostfileError, match=message):
        hostfile.parse_hostfile(text)


def test_parse_processes():
    hosts = hostfile.parse_hostfile(
        "server cpu1:9100 processes=3\nserver cpu2\nworker gpu1\n"
    )
    assert hosts.servers == ("cpu1:9100", "cpu2:9000")
    assert hosts.counts() == (3, 1)
    assert hosts.addresses() == (
        "cpu1:9100",
        "cpu1:9101",
        "cpu1:9102",
        "cpu2:9000",
    )


def test_server_processes_is_the_default_of_lines_without_it():
    hosts = hostfile.parse_hostfile(
        "server a processes=1\nserver b:7000\nworker w\n", processes=2
    )
    assert hosts.counts() == (1, 2)
    assert hosts.addresses() == ("a:9000", "b:7000", "b:7001")


def test_ipv6_server_processes():
    hosts = hostfile.parse_hostfile("server [::1]:9000 processes=2\nworker w")
    assert hosts.addresses() == ("[::1]:9000", "[::1]:9001")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "server a processes=0\nworker b\n",
            "hostfile:1: expected processes=P with P >= 1, got 'processes=0'",
        ),
        (
            "server a procs=2\nworker b\n",
            "hostfile:1: expected processes=P with P >= 1, got 'procs=2'",
        ),
        (
            "server a:65535 processes=2\nworker b\n",
            "hostfile:1: server 'a:65535' with processes=2 needs ports up "
            "to 65536",
        ),
        (
            "server a:9000 processes=2\nserver a:9001\nworker b\n",
            r"listed twice: \['a:9001'\]",
        ),
        ("worker a processes=2\n", "hostfile:1: expected 'server HOST"),
    ],
)
def test_processes_errors_name_the_value(text, message):
    with pytest.raises(hostfile.HostfileError, match=message):
        hostfile.parse_hostfile(text)


def test_ssh_command_lines_with_processes():
    hosts = hostfile.parse_hostfile(
        "server cpu1:9100 processes=2\nserver cpu2\nworker gpu1\n"
    )
    cmds = hostfile.ssh_commands(
        hosts, ["python", "t.py"], job_id="J", timeout=30.0, cwd="/w"
    )
    first, second = (shlex.split(argv[5]) for _, argv in cmds[:2])
    assert first[first.index("--processes") + 1] == "2"
    assert "--processes" not in second
    env = shlex.split(cmds[2][1][5])
    assert "JAXPS_SERVERS=cpu1:9100,cpu1:9101,cpu2:9000" in env


def test_ssh_command_lines():
    hosts = hostfile.parse_hostfile(GOOD)
    cmds = hostfile.ssh_commands(
        hosts,
        ["python", "train.py", "--name", "a b"],
        job_id="J",
        timeout=30.0,
        server_flags=("--async",),
        cwd="/work dir",
    )
    labels = [label for label, _ in cmds]
    assert labels == ["server 0", "server 1", "worker 0", "worker 1"]
    server = cmds[0][1]
    assert server[:5] == ["ssh", "-o", "BatchMode=yes", "-tt", "cpu1"]
    assert shlex.split(server[5]) == [
        "jaxps-server",
        "--host",
        "cpu1",
        "--port",
        "9100",
        "--num-workers",
        "2",
        "--job-id",
        "J",
        "--round-timeout",
        "30.0",
        "--async",
    ]
    worker = cmds[3][1]
    assert worker[4] == "gpu2"
    assert shlex.split(worker[5]) == [
        "cd",
        "/work dir",
        "&&",
        "env",
        "JAXPS_JOB_ID=J",
        "JAXPS_NUM_WORKERS=2",
        "JAXPS_SERVERS=cpu1:9100,cpu2:9000",
        "JAXPS_WORKER_RANK=1",
        "python",
        "train.py",
        "--name",
        "a b",
    ]


def test_dry_run_prints_and_starts_nothing(tmp_path):
    f = tmp_path / "hosts"
    f.write_text(GOOD)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxps._src.launch",
            "--hostfile",
            str(f),
            "--dry-run",
            "--",
            "python",
            "train.py",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and lines[2].startswith("worker 0: ssh ")


FAKE_SSH = """#!/bin/sh
# stand-in for ssh: drop the options and the host, run the command here
for last; do :; done
exec sh -c "$last"
"""


def _launch_through_fake_ssh(tmp_path, hostfile_text: str, code: str, *flags):
    """Runs ``jaxps-launch --hostfile`` with an ``ssh`` that runs every
    command on this host; returns the finished process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text(hostfile_text)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(
        [str(bin_dir), os.path.dirname(sys.executable), env["PATH"]]
    )
    env.pop("JAXPS_SERVERS", None)
    return subprocess.run(
        [sys.executable, "-m", "jaxps._src.launch", "--hostfile", str(hosts)]
        + list(flags)
        + ["--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.timeout(120)
def test_run_through_ssh_on_this_host(tmp_path):
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    code = (
        "import jaxps, numpy as np; jaxps.init(); "
        "y = jaxps.push_pull_numpy('x', np.full(50000, jaxps.rank() + 1.0, "
        "np.float32), average=False); assert (y == 3).all(); print('ok')"
    )
    out = _launch_through_fake_ssh(
        tmp_path,
        f"server 127.0.0.1:{ports[0]}\nserver 127.0.0.1:{ports[1]}\n"
        "worker 127.0.0.1\nworker 127.0.0.1\n",
        code,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 2, out.stdout


@pytest.mark.timeout(120)
def test_run_server_processes_through_ssh_on_this_host(tmp_path):
    for _ in range(100):  # two consecutive free ports
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        break
    code = (
        "import os, jaxps, numpy as np; jaxps.init(partition_bytes=4096); "
        "y = jaxps.push_pull_numpy('x', np.full(50000, jaxps.rank() + 1.0, "
        "np.float32), average=False); assert (y == 3).all(); "
        "print('ok', os.environ['JAXPS_SERVERS'])"
    )
    out = _launch_through_fake_ssh(
        tmp_path,
        f"server 127.0.0.1:{port} processes=2\n"
        "worker 127.0.0.1\nworker 127.0.0.1\n",
        code,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    servers = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
    assert out.stdout.count(f"ok {servers}") == 2, out.stdout


@pytest.mark.timeout(120)
def test_a_killed_server_is_restarted_over_ssh(tmp_path):
    # Rank 0 kills the server (-9) at step 10; --restart-servers starts it
    # again with its ssh command line and the workers fail over to it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import os, signal, jaxps, numpy as np\n"
        "jaxps.init()\n"
        "for step in range(30):\n"
        "    x = np.arange(5000, dtype=np.float32) * (jaxps.rank() + 1)\n"
        "    x += step\n"
        "    y = jaxps.push_pull_numpy('x', x, average=False)\n"
        "    want = np.arange(5000, dtype=np.float32) * 3 + 2 * step\n"
        "    np.testing.assert_array_equal(y, want)\n"
        "    if step == 10 and jaxps.rank() == 0:\n"
        "        for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "            try:\n"
        "                cmd = open(f'/proc/{pid}/cmdline').read()\n"
        "            except OSError:\n"
        "                continue\n"
        f"            if 'jaxps-server' in cmd and '{port}\\0' in cmd:\n"
        "                os.kill(int(pid), signal.SIGKILL)\n"
        "jaxps.shutdown()\n"
        "print('ok')\n"
    )
    out = _launch_through_fake_ssh(
        tmp_path,
        f"server 127.0.0.1:{port}\nworker 127.0.0.1\nworker 127.0.0.1\n",
        code,
        "--restart-servers",
        "1",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 2, out.stdout
    # ssh reports the remote kill as exit code 137
    assert (
        "server 0 ended (exit code 137); starting it again on "
        f"127.0.0.1:{port} over ssh (restart 1 of 1)"
    ) in out.stderr, out.stderr
    assert out.stderr.count("came back") == 2, out.stderr
