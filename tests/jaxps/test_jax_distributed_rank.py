"""Rank and size come from jax.distributed when JAXPS_* does not set them."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, jax, numpy as np, jaxps
    rank, port, servers = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                               process_id=rank)
    jaxps.init(servers=servers.split(","))
    assert (jaxps.rank(), jaxps.size()) == (rank, 2), (jaxps.rank(), rank)
    y = jaxps.push_pull_numpy("x", np.full(10, rank + 1.0, np.float32),
                              average=False)
    assert (y == 3).all()
    print("ok", jaxps.rank(), jaxps.size(), flush=True)
    jaxps.shutdown()
    jax.distributed.shutdown()
    """
)


@pytest.mark.timeout(120)
def test_rank_from_jax_distributed(start_servers, tmp_path):
    (server,) = start_servers(1, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPS_")}
    env["XLA_FLAGS"] = ""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), server.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=100)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        assert f"ok {r} 2" in out, out
