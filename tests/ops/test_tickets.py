"""Tickets whose done never ran (their program failed between start and
done) are released by the next init, with the sums they hold."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import jaxps
    from jaxps.ops import _host

    x = np.ones(1 << 20, np.float32)
    jaxps.init(num_workers=1)
    for name in ("a", "b", "c"):  # three starts whose done never runs
        _host.start((name,), False, (0,), "sync", 0, x)
    assert len(_host._tickets) == 3
    jaxps.shutdown()
    jaxps.init(num_workers=1)
    ticket = _host.start(("d",), False, (0,), "sync", 0, x)
    assert list(_host._tickets) == [int(ticket)], _host._tickets
    (out,) = _host.done(ticket)
    assert (out == 1).all() and not _host._tickets
    jaxps.shutdown()
    print("ok")
    """
)


@pytest.mark.timeout(120)
def test_a_new_init_releases_the_tickets_of_the_last():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
