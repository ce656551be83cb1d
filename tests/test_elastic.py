"""Elastic workers (`jaxps.elastic`): a lost worker and a joining one.

Real servers and real worker processes training a jitted optax model with
`jaxps.DistributedOptimizer`. One worker is killed (-9) mid-run, or one is
started mid-run; the others must finish every step, and every worker's
final parameters must be bitwise equal. Each step also sums a one per
worker, which must equal `jaxps.size()`: a contribution of an old
membership mixed into the new one's sums would break it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

STEPS = 40
TIMEOUT = 3.0  # JAXPS_TIMEOUT: a lost worker is noticed after this
SETTLE = 1.0

WORKER = textwrap.dedent(
    f"""
    import hashlib, os, time
    import numpy as np, jax, jax.numpy as jnp, optax
    import jaxps

    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 8)).astype(np.float32)
    Y = X @ rng.normal(size=(8,)).astype(np.float32)
    opt = jaxps.DistributedOptimizer(optax.sgd(0.05))
    params = {{"w": jnp.zeros(8)}}
    state = jaxps.elastic.State(params=params, opt_state=opt.init(params),
                                step=0)

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    began = time.monotonic()

    # the join test slows the 2-worker steps, so the newcomer comes in time
    slow = float(os.environ.get("SLOW_WITH_2", "0"))

    @jaxps.elastic.run(settle={SETTLE}, join_timeout=60)
    def train(state):
        rank, n = jaxps.rank(), jaxps.size()
        print("generation", rank, n, state.step,
              round(time.monotonic() - began, 3), flush=True)
        while state.step < {STEPS}:
            x, y = X[rank::n], Y[rank::n]  # this rank's share of the data
            state.params, state.opt_state, loss = step(
                state.params, state.opt_state, x, y)
            count = jaxps.push_pull_numpy(
                "count", np.ones(1, np.float32), average=False)
            assert count[0] == n, (count, n)
            state.step += 1
            if state.step == 10 and os.environ.get("JAXPS_WORKER_RANK") == (
                    os.environ.get("DIE_AS_RANK")):
                os.kill(os.getpid(), 9)
            print("step", state.step, n, round(time.monotonic() - began, 3),
                  float(loss), flush=True)
            time.sleep(slow if n == 2 and state.step > 10 else 0.05)
            state.commit()

    train(state)
    w = np.asarray(state.params["w"])
    print("final", hashlib.sha256(w.tobytes()).hexdigest(), flush=True)
    """
)


def _env(servers, n):
    return dict(
        os.environ,
        JAXPS_SERVERS=",".join(s.address for s in servers),
        JAXPS_NUM_WORKERS=str(n),
        JAXPS_TIMEOUT=str(TIMEOUT),
        JAXPS_PARTITION_BYTES="4096",
    )


def _worker(script, env, rank):
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=dict(env, JAXPS_WORKER_RANK=str(rank)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=script.parent,
    )


def _read_until(worker, prefix, lines):
    for line in worker.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError("".join(lines))


def _steps(out):
    """(step, size, seconds) of every step line."""
    return [
        (int(p[1]), int(p[2]), float(p[3]))
        for p in (line.split() for line in out.splitlines())
        if p and p[0] == "step"
    ]


def _finish(workers, first_lines):
    outs = []
    for rank, w in enumerate(workers):
        rest, _ = w.communicate(timeout=90)
        out = "".join(first_lines.get(rank, [])) + rest
        assert w.returncode == 0, f"worker {rank}:\n{out}"
        outs.append(out)
    return outs


def _reap(workers):
    for w in workers:
        if w.poll() is None:
            w.kill()
            w.wait()
        w.stdout.close()


def _final(out):
    finals = [line for line in out.splitlines() if line.startswith("final")]
    assert len(finals) == 1, out
    return finals[0]


@pytest.mark.timeout(150)
def test_survivors_of_a_killed_worker_finish(tmp_path, start_servers):
    servers = start_servers(2, 3)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = _env(servers, 3)
    workers = [_worker(script, env, r) for r in range(3)]
    try:
        lines = {0: []}
        _read_until(workers[0], "step 10 ", lines[0])
        workers[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        workers[2].wait(10)
        _read_until(workers[0], "generation", lines[0])
        regrouped = time.monotonic() - killed
        outs = _finish(workers[:2], lines)
        for out in outs:
            steps = _steps(out)
            assert steps[-1][:2] == (STEPS, 2), out
            # every step after the first at n=3 completes, in order
            assert [s for s, _, _ in steps] == sorted(s for s, _, _ in steps), (
                out
            )
            assert "generation 0 3" in out or "generation 1 3" in out, out
            assert len({s for s, n, _ in steps if n == 2}) > 10, out
        assert _final(outs[0]) == _final(outs[1])
        losses = [
            float(line.split()[4])
            for line in outs[0].splitlines()
            if line.startswith("step ")
        ]
        assert losses[-1] < 0.1 * losses[0], losses
        after = [t for _, n, t in _steps(outs[0]) if n == 2]
        before = [t for _, n, t in _steps(outs[0]) if n == 3]
        print(
            f"worker 2 killed after step 10: the survivors re-formed "
            f"{regrouped:.2f} s later (timeout {TIMEOUT:g} s, settle "
            f"{SETTLE:g} s); worker loss to the next completed step: "
            f"{after[0] - before[-1]:.2f} s"
        )
    finally:
        _reap(workers)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_worker_started_mid_run_joins(tmp_path, start_servers):
    servers = start_servers(2, 2)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(_env(servers, 2), SLOW_WITH_2="0.5")
    workers = [_worker(script, env, r) for r in range(2)]
    try:
        lines = {0: []}
        _read_until(workers[0], "step 10 ", lines[0])
        workers.append(_worker(script, dict(env, JAXPS_NUM_WORKERS="3"), 2))
        started = time.monotonic()
        lines[2] = []
        _read_until(workers[2], "generation", lines[2])
        joined = time.monotonic() - started
        outs = _finish(workers, lines)
        for out in outs:
            assert _steps(out)[-1][:2] == (STEPS, 3), out
        first = _steps(outs[2])[0]
        assert first[0] > 10 and first[1] == 3, outs[2]  # it got the state
        assert _final(outs[0]) == _final(outs[1]) == _final(outs[2])
        print(
            f"a worker started after step 10 joined at step {first[0] - 1}, "
            f"{joined:.2f} s after it started (JAX import included)"
        )
    finally:
        _reap(workers)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_launcher_lets_an_elastic_job_go_on(tmp_path):
    # The launcher's rank 2 kills itself at step 10: with --elastic the
    # launcher reports it and the survivors finish.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, DIE_AS_RANK="2")
    env.pop("JAXPS_SERVERS", None)
    out = subprocess.run(
        [sys.executable, "-m", "jaxps._src.launch", "--workers", "3"]
        + ["--servers", "2", "--timeout", str(TIMEOUT), "--elastic"]
        + ["--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "worker 2 failed (SIGKILL); 2 worker(s) go on (--elastic)" in (
        out.stderr
    ), out.stderr
    finals = {
        line.split()[-1]
        for line in out.stdout.splitlines()
        if line.startswith(("[worker 0] final", "[worker 1] final"))
    }
    assert len(finals) == 1, out.stdout
    assert f"[worker 0] step {STEPS} 2 " in out.stdout, out.stdout
