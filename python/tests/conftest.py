import os
import sys

import pytest

import ibex

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))


@pytest.fixture
def launch(tmp_path):
    """launch(num_ps, **kw) -> LocalCluster; every cluster is stopped after the test."""
    started = []

    def start(num_ps=2, num_workers=1, **kw):
        kw.setdefault("directory", str(tmp_path / f"cluster-{len(started)}"))
        kw.setdefault("sync_timeout_secs", 10)
        c = ibex.launch_local(num_ps, num_workers, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()
