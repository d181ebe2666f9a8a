"""Ibex from Python: parameter-server training over Ibex shm/tcp/verbs.

    import ibex
    cluster = ibex.launch_local(num_ps=2)            # or a cluster TOML, TF_CONFIG, Slurm
    w = ibex.Worker.connect(cluster=cluster, index=0)
    w.create_variables([ibex.Variable("w", (64, 10), optimizer=ibex.SGD(0.1))])
    fresh = w.push_pull(step, {"w": grad})           # grad: float32 NumPy array, read in place

See docs/python.md for the whole API.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._native import (
    BufferBusyError,
    DeadlineError,
    IbexError,
    PsTimeoutError,
    RejectedError,
    ShapeMismatchError,
    SpecError,
    StaleStepError,
    UnavailableError,
    UnknownVariableError,
)
from ._native import Spec as ClusterSpec
from .local import LocalCluster, launch_local

__all__ = [
    "Worker",
    "StepPush",
    "Variable",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "ClusterSpec",
    "LocalCluster",
    "launch_local",
    "IbexError",
    "UnknownVariableError",
    "ShapeMismatchError",
    "StaleStepError",
    "PsTimeoutError",
    "DeadlineError",
    "UnavailableError",
    "RejectedError",
    "BufferBusyError",
    "SpecError",
]


# Optimizers, applied on the PS (docs/ps.md, "Optimizers").
@dataclass(frozen=True)
class SGD:
    """Plain SGD on the PS: `value -= lr * mean gradient`."""

    lr: float

    def _native(self) -> "OptTuple":
        return ("sgd", self.lr, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Momentum:
    """SGD with momentum on the PS (no nesterov, no dampening)."""

    lr: float
    momentum: float = 0.9

    def _native(self) -> "OptTuple":
        return ("momentum", self.lr, self.momentum, 0.0, 0.0)


@dataclass(frozen=True)
class Adagrad:
    """Adagrad on the PS, accumulator starting at zero."""

    lr: float
    eps: float = 1e-7

    def _native(self) -> "OptTuple":
        return ("adagrad", self.lr, self.eps, 0.0, 0.0)


@dataclass(frozen=True)
class Adam:
    """Adam on the PS (no weight decay, no amsgrad)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def _native(self) -> "OptTuple":
        return ("adam", self.lr, self.beta1, self.beta2, self.eps)


OptTuple = Tuple[str, float, float, float, float]
Init = Union[str, Tuple[str, float]]
Optimizer = Union[SGD, Momentum, Adagrad, Adam]


@dataclass
class Variable:
    """One model variable. `init` is "zeros", "glorot_uniform", ("constant", value) or
    ("normal", std); random initializers use `seed`. `dtype` is the PS's storage dtype
    (float32, float16, bfloat16); values and gradients always cross as float32. A sparse
    table is `(rows, dim)` and is used with `lookup_rows` / `push_sparse`."""

    name: str
    shape: Sequence[int]
    init: Init = "zeros"
    optimizer: Optimizer = field(default_factory=lambda: SGD(0.01))
    seed: int = 0
    dtype: str = "float32"
    sparse: bool = False

    def _native(self):
        if isinstance(self.init, str):
            kind, value = self.init, 0.0
        else:
            kind, value = self.init
        return (
            self.name,
            [int(d) for d in self.shape],
            str(self.dtype),
            (kind, float(value), int(self.seed)),
            self.optimizer._native(),
            bool(self.sparse),
        )


Grads = Union[Dict[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]]


def _pairs(grads: Grads) -> List[Tuple[str, np.ndarray]]:
    if isinstance(grads, dict):
        return list(grads.items())
    return list(grads)


def _torchrun_spec() -> Optional["ClusterSpec"]:
    """The cluster of a torchrun (or torch.distributed.launch) job: RANK and WORLD_SIZE
    from the launcher, the PS from IBEX_PS (`host:port,host:port,...`) or a spec file
    named by IBEX_CLUSTER. None outside such a job."""
    if os.environ.get("RANK") is None or os.environ.get("WORLD_SIZE") is None:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise SpecError(
            f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be "
            "integers (torchrun sets them)"
        ) from None
    if not 0 <= rank < world:
        raise SpecError(f"RANK={rank} is outside WORLD_SIZE={world}")
    path = os.environ.get("IBEX_CLUSTER")
    ps = os.environ.get("IBEX_PS")
    if path:
        spec = ClusterSpec.from_file(path)
        if len(spec.workers) != world:
            raise SpecError(
                f"{path} lists {len(spec.workers)} workers but torchrun started WORLD_SIZE={world}: "
                "list one worker per rank"
            )
        return spec.with_task("worker", rank)
    if not ps:
        raise SpecError(
            "this is a torchrun job (RANK, WORLD_SIZE) but Ibex does not know its PS: set "
            "IBEX_PS=host:port,host:port (one per PS shard) or IBEX_CLUSTER=cluster.toml"
        )
    addrs = [a.strip() for a in ps.split(",") if a.strip()]
    transport = os.environ.get("IBEX_TRANSPORT", "tcp")
    # Workers only connect out: their addresses name them, no one connects to them.
    master = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    toml = (
        "[cluster]\n"
        f"ps = {json.dumps(addrs)}\n"
        f"workers = {json.dumps([master] * world)}\n"
        f"transport = {json.dumps(transport)}\n"
    )
    if os.environ.get("IBEX_SYNC_TIMEOUT_SECS"):
        toml += f"sync_timeout_secs = {float(os.environ['IBEX_SYNC_TIMEOUT_SECS'])}\n"
    return ClusterSpec.from_toml(toml).with_task("worker", rank)


def _spec(cluster: "ClusterArg") -> "ClusterSpec":
    """A ClusterSpec from what `Worker.connect` accepts."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, LocalCluster):
        return cluster.spec
    if cluster is None:
        if os.environ.get("TF_CONFIG"):
            return ClusterSpec.from_tf_config(os.environ["TF_CONFIG"])
        if os.environ.get("SLURM_PROCID") is not None:
            return ClusterSpec.from_slurm()
        spec = _torchrun_spec()
        if spec is not None:
            return spec
        raise SpecError(
            "no cluster given and none in the environment (TF_CONFIG, a Slurm step, or "
            "torchrun's RANK/WORLD_SIZE with IBEX_PS or IBEX_CLUSTER): pass cluster= a TOML "
            "file, TOML text, 'tf_config', 'slurm' or 'torchrun'"
        )
    if cluster == "tf_config":
        if not os.environ.get("TF_CONFIG"):
            raise SpecError("cluster='tf_config' but TF_CONFIG is not set")
        return ClusterSpec.from_tf_config(os.environ["TF_CONFIG"])
    if cluster == "slurm":
        return ClusterSpec.from_slurm()
    if cluster == "torchrun":
        spec = _torchrun_spec()
        if spec is None:
            raise SpecError("cluster='torchrun' but RANK and WORLD_SIZE are not set: run under torchrun")
        return spec
    if isinstance(cluster, (str, os.PathLike)):
        text = os.fspath(cluster)
        if "[cluster]" in text:
            return ClusterSpec.from_toml(text)
        return ClusterSpec.from_file(text)
    raise TypeError(
        f"cluster must be a path, TOML text, 'tf_config', 'slurm', 'torchrun', a ClusterSpec or "
        f"a LocalCluster, not {type(cluster).__name__}"
    )


ClusterArg = Union[None, str, "os.PathLike[str]", ClusterSpec, LocalCluster]


class Worker:
    """A training process's handle on the parameter servers (the Rust `ibex_worker::Worker`).

    Arrays are float32 NumPy arrays in C order, of the variable's shape (or flat). Every
    call that waits on the network releases the GIL. Errors are `IbexError` subclasses
    carrying the Rust message."""

    def __init__(self, native: "_native.Worker", spec: ClusterSpec, index: int):
        self._w = native
        self.spec = spec
        self.index = index
        #: LOCAL_RANK under torchrun (this process's slot on its host, for picking a
        #: device), else None.
        self.local_rank: Optional[int] = _local_rank()

    @classmethod
    def connect(
        cls,
        cluster: ClusterArg = None,
        index: Optional[int] = None,
        *,
        connect_timeout: Optional[float] = None,
        call_timeout: Optional[float] = None,
        sync_timeout: Optional[float] = None,
        keepalive: Optional[float] = None,
    ) -> "Worker":
        """Connects to every PS of `cluster`: a cluster TOML file or text, 'tf_config',
        'slurm' or 'torchrun' (or None: whichever of those the environment has), a
        ClusterSpec or a LocalCluster. `index` is this worker's index (default: the one
        TF_CONFIG, Slurm or torchrun's RANK gives).

        Under torchrun, `Worker.connect()` reads RANK and WORLD_SIZE, the PS addresses from
        IBEX_PS (`host:port,host:port`, transport IBEX_TRANSPORT, default tcp) or a cluster
        TOML named by IBEX_CLUSTER, and keeps LOCAL_RANK as `local_rank`.

        The bounds, in seconds, override the spec's (docs/ps.md, "Failures"):
        `connect_timeout` for reaching each PS, `call_timeout` for every call after,
        `sync_timeout` the PS's sync timeout that both follow unless given (connect: the
        same, call: 10 s more), `keepalive` the ping interval (0: off)."""
        spec = _spec(cluster)
        if any(v is not None for v in (connect_timeout, call_timeout, sync_timeout, keepalive)):
            spec = spec.with_timeouts(
                sync=sync_timeout, connect=connect_timeout, call=call_timeout, keepalive=keepalive
            )
        if spec.job is not None and spec.job != "worker" and index is None:
            raise SpecError(
                f"this task is a {spec.job} task, not a worker: run the PS with "
                "`python -m ibex.ps` instead"
            )
        if index is None:
            index = spec.index
        if index is None:
            raise SpecError("pass index=: the cluster spec does not say which worker this is")
        return cls(_native.Worker.connect(spec, int(index)), spec, int(index))

    @property
    def num_ps(self) -> int:
        """Number of PS shards."""
        return self._w.num_ps

    def create_variables(self, variables: Sequence[Variable]) -> None:
        """Places the variables across the PS (greedy by bytes; > 1 MiB split along dim 0)
        and creates them. Every worker passes the same list in the same order."""
        self._w.create_variables([v._native() for v in variables])

    def shape(self, name: str) -> Tuple[int, ...]:
        """The full shape of a created variable."""
        s = self._w.shape(name)
        if s is None:
            raise UnknownVariableError(f"unknown variable {name!r}: create it with create_variables first")
        return tuple(s)

    def placement(self, name: str):
        """`[(ps, part_name, row_offset, rows)]` of a created variable."""
        p = self._w.placement(name)
        if p is None:
            raise UnknownVariableError(f"unknown variable {name!r}: create it with create_variables first")
        return p

    def push(self, step: int, grads: Grads) -> None:
        """Contributes `grads` ({name: array}) to `step`. Each array is read in place and
        copied once, into the variable's registered buffer, as in Rust's `Worker::push`."""
        self._w.push(int(step), _pairs(grads))

    def pull(self, names: Sequence[str], step: int, out: Optional[Sequence[np.ndarray]] = None):
        """Values of `names` after `step` steps: new arrays that own the pulled memory, or
        written into `out` (one float32 array per name; returns None)."""
        return self._w.pull(list(names), int(step), None if out is None else list(out))

    def push_pull(self, step: int, grads: Grads, out: Optional[Sequence[np.ndarray]] = None):
        """Pushes `grads` for `step`, waits for the step, and returns the fresh values of the
        same variables in the same order (or writes them into `out`)."""
        return self._w.push_pull(int(step), _pairs(grads), None if out is None else list(out))

    def stage(self, names: Sequence[str], timeout: float = 30.0) -> "_native.Staged":
        """A write lease on the registered gradient buffers of `names`: `staged.array(name)`
        is a writable NumPy view of one (no copy on the worker when pushed). Waits while an
        earlier push of one of them is in flight or another lease holds one, at most
        `timeout` seconds (then BufferBusyError)."""
        return self._w.stage(list(names), float(timeout))

    def try_stage(self, names: Sequence[str]) -> "_native.Staged":
        """As `stage`, raising BufferBusyError instead of waiting."""
        return self._w.try_stage(list(names))

    def push_staged(self, step: int, staged: "_native.Staged") -> None:
        """Pushes a staging lease for `step` (no copy on the worker); its views turn
        read-only, since the PS may still read the buffers."""
        self._w.push_staged(int(step), staged)

    def push_pull_staged(
        self, step: int, staged: "_native.Staged", out: Optional[Sequence[np.ndarray]] = None
    ) -> Optional[List[np.ndarray]]:
        """`push_staged`, then the fresh values of the staged variables in staging order:
        new arrays, or read straight into `out` (returns None)."""
        return self._w.push_pull_staged(int(step), staged, None if out is None else list(out))

    # asyncio: the blocking calls release the GIL, so running them on the loop's default
    # executor lets other coroutines (and the other calls) proceed meanwhile.
    async def apush(self, step: int, grads: Grads) -> None:
        """`push` for asyncio code."""
        await _in_thread(self.push, step, grads)

    async def apull(self, names: Sequence[str], step: int, out: Optional[Sequence[np.ndarray]] = None):
        """`pull` for asyncio code."""
        return await _in_thread(self.pull, names, step, out)

    async def apush_pull(self, step: int, grads: Grads, out: Optional[Sequence[np.ndarray]] = None):
        """`push_pull` for asyncio code."""
        return await _in_thread(self.push_pull, step, grads, out)

    def begin_step(self, step: int) -> "StepPush":
        """Per-layer pushes for `step`: `s.push({name: grad})` sends in the background and
        returns at once; `s.finish_pull(names)` joins them and pulls step + 1."""
        return StepPush(self._w.begin_step(int(step)))

    def lookup_rows(self, table: str, ids) -> np.ndarray:
        """Rows `ids` of sparse table `table`, as a `(len(ids), dim)` array."""
        return self._w.lookup_rows(table, _ids(ids))

    def push_sparse(self, step: int, table: str, ids, grads: np.ndarray) -> None:
        """Row gradients `(len(ids), dim)` of `table` for `step` (sync mode: every worker
        pushes every table each step, `ids` may be empty)."""
        self._w.push_sparse(int(step), table, _ids(ids), grads)

    def save(self) -> List[int]:
        """Every PS writes a checkpoint now; returns their steps."""
        return self._w.save()

    def restore(self) -> int:
        """Restores every PS to the newest checkpoint step they all hold, and returns it."""
        return self._w.restore()

    def current_step(self) -> int:
        """The number of steps every PS has applied (the step to push next)."""
        return self._w.current_step()

    def stats(self) -> List[dict]:
        """Every PS's Stats (step, mode, variables, bytes, RPC counts), in PS order."""
        return self._w.stats()

    def comm_profile(self) -> str:
        """Message sizes by path, RPC counts and transport counters, as `ibex demo` prints."""
        return self._w.comm_profile()

    def connection_stats(self) -> Dict[int, dict]:
        """Each Ibex connection's transport counters, by PS index."""
        return dict(self._w.connection_stats())

    def staging_info(self, name: str):
        """Each part's staging buffer: `[(ps, bytes, fallback)]`; fallback None means it
        lies in the connection's registered pool."""
        return self._w.staging_info(name)

    def __repr__(self) -> str:
        return f"ibex.Worker(index={self.index}, num_ps={self.num_ps}, transport={self.spec.transport!r})"


class StepPush:
    """One step's per-layer pushes (`Worker.begin_step`)."""

    def __init__(self, native: "_native.StepPush"):
        self._s = native

    @property
    def step(self) -> int:
        """The step these pushes contribute to."""
        return self._s.step

    def push(self, grads: Grads) -> None:
        """Sends `grads` in the background (copied once, so the arrays may be reused)."""
        self._s.push(_pairs(grads))

    def push_staged(self, staged: "_native.Staged") -> None:
        """Sends a staging lease (`Worker.stage`) in the background and returns at once:
        the gradients were written into the registered buffers, so nothing is copied. The
        lease's views become read-only."""
        self._s.push_staged(staged)

    def finish(self) -> None:
        """Waits until every push of the step was accepted by its PS."""
        self._s.finish()

    def finish_pull(
        self, names: Sequence[str], out: Optional[Sequence[np.ndarray]] = None
    ) -> Optional[List[np.ndarray]]:
        """Waits for the pushes, then returns the values of `names` after this step (new
        arrays), or reads them straight into `out` (returns None)."""
        return self._s.finish_pull(list(names), None if out is None else list(out))


def _local_rank() -> Optional[int]:
    v = os.environ.get("LOCAL_RANK")
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


async def _in_thread(fn, *args):
    import asyncio
    import functools

    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def _ids(ids) -> List[int]:
    a = np.asarray(ids)
    if a.size == 0:
        return []
    if a.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {a.shape}")
    if a.dtype.kind == "i" and (a < 0).any():
        raise ValueError("ids must be non-negative row indices")
    return a.astype(np.uint64).tolist()
