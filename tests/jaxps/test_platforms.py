"""jaxps.init refuses a JAX platform list without the CPU, at once."""

import os
import subprocess
import sys

import pytest


def _run(platforms: str, code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a Python with JAX_PLATFORMS=`platforms`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPS_")}
    env["JAX_PLATFORMS"] = platforms
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )


@pytest.mark.timeout(60)
def test_jax_platforms_without_cpu_fails_at_init_naming_the_fix():
    result = _run("cuda", "import jaxps; jaxps.init(num_workers=1)")
    assert result.returncode != 0
    assert "ConfigError" in result.stderr, result.stderr
    assert "JAX_PLATFORMS='cuda,cpu'" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_jax_platforms_with_cpu_is_accepted():
    result = _run(
        "cpu",
        "import jaxps; jaxps.init(num_workers=1); "
        "print(float(jaxps.push_pull(1.0))); jaxps.shutdown()",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.0"
