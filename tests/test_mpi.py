"""``mpirun -np N python train.py`` with the servers started separately: the
ranks come from Open MPI's variables, with a real ``mpirun`` (Open MPI from
the Debian packages, which ``.ci/run`` installs)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

MPIRUN = shutil.which("mpirun")

WORKER = textwrap.dedent(
    """
    import os, numpy as np, jaxps

    jaxps.init()  # rank and size from mpirun, servers from JAXPS_SERVERS
    rank, size = jaxps.rank(), jaxps.size()
    assert rank == int(os.environ["OMPI_COMM_WORLD_RANK"]), rank
    assert "JAXPS_WORKER_RANK" not in os.environ
    got = jaxps.push_pull_numpy("w", np.full(1000, rank + 1.0, np.float32),
                                average=False)
    assert np.all(got == size * (size + 1) / 2), got[:3]
    print(f"OK rank {rank} of {size}", flush=True)
    jaxps.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun (Open MPI)")
@pytest.mark.timeout(120)
def test_mpirun_gives_the_ranks(start_servers, tmp_path):
    servers = start_servers(2, 3)
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXPS_") and k != "XLA_FLAGS"
    }
    env.update(
        JAXPS_SERVERS=",".join(s.address for s in servers),
        JAXPS_TIMEOUT="30",
        JAX_PLATFORMS="cpu",
    )
    argv = [MPIRUN, "-np", "3", "--oversubscribe"]
    if os.geteuid() == 0:  # containers: Open MPI refuses root without it
        argv.append("--allow-run-as-root")
    # -x: what a multi-host mpirun must forward (locally it is inherited)
    argv += ["-x", "JAXPS_SERVERS", "-x", "JAXPS_TIMEOUT"]
    argv += [sys.executable, str(script)]
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    # mpirun interleaves the ranks' output, not always at line ends
    assert sorted(re.findall(r"OK rank (\d) of 3", out)) == ["0", "1", "2"], out
