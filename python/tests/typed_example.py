"""A typed training loop that mypy checks against the package's annotations and stubs
(test_house.py runs mypy on it)."""

from typing import List, Optional

import numpy as np
import numpy.typing as npt

import ibex


def train(cluster: ibex.LocalCluster, steps: int) -> List[npt.NDArray[np.float32]]:
    w: ibex.Worker = ibex.Worker.connect(cluster=cluster, index=0, call_timeout=10.0)
    w.create_variables([ibex.Variable("w", (4, 2), "glorot_uniform", ibex.Momentum(0.1), seed=1)])
    values: Optional[List[npt.NDArray[np.float32]]] = w.pull(["w"], 0)
    assert values is not None
    for step in range(steps):
        staged = w.stage(["w"])
        staged.array("w")[...] = 0.5
        out = w.push_pull_staged(step, staged)
        assert out is not None
        values = out
    n: int = w.num_ps
    assert n == cluster.num_ps
    return values
