"""PyTorch on Ibex parameter servers, in the style of Horovod's and BytePS's
`DistributedOptimizer`:

    import ibex, ibex.torch
    worker = ibex.Worker.connect(cluster="cluster.toml", index=rank)
    optimizer = ibex.torch.DistributedOptimizer(optimizer, model.named_parameters(), worker)

The wrapped optimizer's kind and hyper-parameters (SGD with or without momentum, Adagrad,
Adam) become the PS's optimizer: the PS applies the update, so the local optimizer never
steps. Each gradient is copied once, into the worker's registered buffer for its
variable, and pushed either from a gradient hook as soon as backward has produced it (the
push overlaps the rest of backward) or with the others in `step()`; by default the
optimizer times both and keeps the faster. `step()` waits for the step and reads the fresh
weights straight into the parameters' memory before the next forward pass. Sync or async
is the PS's `--mode` (`launch_local(mode=...)`): in sync mode the PS averages the workers'
gradients once per step; in async mode every push is applied on arrival and pulls never
wait.

Import it only where torch is installed: `import ibex` never imports torch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "ibex.torch needs PyTorch: pip install torch (the NumPy API, `import ibex`, works without it)"
    ) from e

import ibex

__all__ = ["DistributedOptimizer", "ps_optimizer"]


def ps_optimizer(opt: "torch.optim.Optimizer"):
    """The PS optimizer equivalent to a torch optimizer's first parameter group."""
    g = opt.param_groups[0]
    if isinstance(opt, torch.optim.SGD):
        if g.get("nesterov") or g.get("dampening", 0) or g.get("weight_decay", 0):
            raise ValueError(
                "the PS applies SGD/momentum without nesterov, dampening or weight decay; "
                "turn those off or add weight decay to the loss"
            )
        m = g.get("momentum", 0.0)
        return ibex.Momentum(g["lr"], m) if m else ibex.SGD(g["lr"])
    if isinstance(opt, torch.optim.Adam):
        if g.get("weight_decay", 0) or g.get("amsgrad"):
            raise ValueError("the PS applies plain Adam: turn off weight_decay and amsgrad")
        b1, b2 = g["betas"]
        return ibex.Adam(g["lr"], b1, b2, g["eps"])
    if isinstance(opt, torch.optim.Adagrad):
        if g.get("initial_accumulator_value", 0) or g.get("lr_decay", 0) or g.get("weight_decay", 0):
            raise ValueError(
                "the PS applies Adagrad with a zero initial accumulator and no decay"
            )
        return ibex.Adagrad(g["lr"], g["eps"])
    raise ValueError(
        f"{type(opt).__name__} has no PS equivalent: use torch.optim.SGD, Adam or Adagrad"
    )


def _default_init(name: str, p: "torch.Tensor"):
    return "glorot_uniform" if p.dim() >= 2 else "zeros"


def _named(named_parameters) -> List[Tuple[str, "torch.nn.Parameter"]]:
    """The (name, parameter) pairs, or a TypeError that names the usual mistake."""
    if isinstance(named_parameters, torch.Tensor):
        raise TypeError(
            "DistributedOptimizer takes model.named_parameters(), (name, parameter) pairs, "
            "and got a single tensor"
        )
    out = []
    for item in named_parameters:
        if isinstance(item, torch.Tensor):
            raise TypeError(
                "DistributedOptimizer takes (name, parameter) pairs and got a bare tensor: pass "
                "model.named_parameters() instead of model.parameters() (the names become "
                "the PS variables' names, the same on every worker)"
            )
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"DistributedOptimizer takes (name, parameter) pairs as model.named_parameters() "
                f"yields them, got {type(item).__name__}"
            )
        out.append(item)
    return out


# Steps run before the automatic overlap choice starts timing, and steps timed each way.
_WARMUP_STEPS = 2
_PROBE_STEPS = 3


class DistributedOptimizer:
    """Wraps `optimizer` so that `step()` trains through the parameter servers of
    `worker` (see the module docstring). `named_parameters` names the PS variables
    (prefixed by `prefix`); every worker must pass the same model. `init(name, param)`
    picks each variable's PS initializer (default: Glorot-uniform for matrices and
    kernels, zeros for vectors); the PS values replace the local ones at construction.

    `overlap`: True pushes each gradient from its hook during backward; False pushes them
    all in `step()`, one request per PS; "auto" (the default) times a few steps each way
    after a short warm-up and keeps the faster (`overlap_chosen` says which). Either way
    each gradient is copied once, into the worker's registered buffer, and the fresh
    values are read straight into the parameters' memory."""

    def __init__(
        self,
        optimizer: "torch.optim.Optimizer",
        named_parameters: Iterable[Tuple[str, "torch.nn.Parameter"]],
        worker: "ibex.Worker",
        *,
        prefix: str = "",
        init: Callable[[str, "torch.Tensor"], ibex.Init] = _default_init,
        seed: int = 0,
        overlap: Union[bool, str] = "auto",
        start_step: int = 0,
    ):
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', not {overlap!r}")
        self.optimizer = optimizer
        self.worker = worker
        self.overlap = overlap
        self.step_count = start_step
        self._params: List[Tuple[str, torch.nn.Parameter]] = []
        seen = set()
        for name, p in _named(named_parameters):
            if not p.requires_grad:
                continue
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(
                    f"parameter {name!r} is {p.dtype} on {p.device}: ibex.torch trains float32 CPU parameters"
                )
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous")
            if id(p) in seen:
                continue
            seen.add(id(p))
            self._params.append((prefix + name, p))
        if not self._params:
            raise ValueError("no trainable parameters given")
        self._names = [n for n, _ in self._params]
        opt = ps_optimizer(optimizer)
        worker.create_variables(
            [
                ibex.Variable(n, tuple(p.shape), init(n, p), opt, seed=seed + i)
                for i, (n, p) in enumerate(self._params)
            ]
        )
        self._pushed: Dict[str, bool] = {}
        self._step_push: Optional[ibex.StepPush] = None
        self._hooks: list = []
        # The automatic choice: None while probing, then True or False.
        self._chosen: Optional[bool] = None if overlap == "auto" else bool(overlap)
        self._probe: Dict[bool, List[float]] = {True: [], False: []}
        self._last_step_end: Optional[float] = None
        self._steps_seen = 0
        if overlap is not False:
            for name, p in self._params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(name)))
        # Pull the PS's values (the step this job is at) into the parameters.
        self._pull_into_params(self.step_count)

    @property
    def overlap_chosen(self) -> Optional[bool]:
        """Whether gradients are pushed from the hooks: `overlap` when given, else what the
        automatic choice settled on (None while it is still timing steps)."""
        return self._chosen

    def _overlapping_now(self) -> bool:
        if self._chosen is not None:
            return self._chosen
        k = self._steps_seen - _WARMUP_STEPS
        # Warm-up and probe steps alternate, so drift on a shared machine hits both ways.
        return k < 0 or k % 2 == 0

    def _hook(self, name: str):
        def hook(p: "torch.Tensor") -> None:
            if p.grad is None or self._pushed.get(name) or not self._overlapping_now():
                return
            if self._step_push is None:
                self._step_push = self.worker.begin_step(self.step_count)
            # One copy into the registered buffer, then the push goes in the background
            # while backward computes the layers below.
            self._step_push.push({name: _f32(name, p.grad)})
            self._pushed[name] = True

        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, as the wrapped optimizer's `zero_grad`."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Pushes the gradients not yet pushed (zeros for parameters that got none, since
        a sync step needs every variable), waits for the step and reads the new weights
        into the parameters. Returns the closure's loss, if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        overlapped = self._overlapping_now()
        # The fresh values are read straight into the parameters' memory.
        out = [p.detach().numpy() for _, p in self._params]
        try:
            if self._step_push is None:
                # Everything at once: one copy of each gradient into its registered
                # buffer, one request per PS.
                self.worker.push_pull(self.step_count, self._grads(), out=out)
            else:
                sp = self._step_push
                rest = self._grads(skip=self._pushed)
                if rest:
                    sp.push(rest)
                sp.finish_pull(self._names, out=out)
        finally:
            self._step_push = None
            self._pushed = {}
        self.step_count += 1
        self._time_step(overlapped)
        return loss

    def _grads(self, skip=()) -> List[Tuple[str, np.ndarray]]:
        """(name, gradient) of the parameters not in `skip`; zeros for those that got no
        gradient, since a sync step needs every variable."""
        return [
            (name, _f32(name, p.grad) if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
            for name, p in self._params
            if name not in skip
        ]

    def _time_step(self, overlapped: bool) -> None:
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, now
        self._steps_seen += 1
        if self._chosen is not None or last is None:
            return
        if self._steps_seen > _WARMUP_STEPS:
            self._probe[overlapped].append(now - last)
        on, off = self._probe[True], self._probe[False]
        if len(on) >= _PROBE_STEPS and len(off) >= _PROBE_STEPS:
            self._chosen = statistics.median(on) < statistics.median(off)

    def _pull_into_params(self, step: int) -> None:
        with torch.no_grad():
            self.worker.pull(self._names, step, out=[p.detach().numpy() for _, p in self._params])

    def remove_hooks(self) -> None:
        """Removes the gradient hooks (gradients are then pushed in `step()`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._chosen = False

    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def state_dict(self) -> Dict[str, int]:
        """The training step; the weights and the optimizer state live on the PS."""
        return {"step": self.step_count}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Resumes at `state["step"]` and pulls that step's weights into the parameters."""
        self.step_count = int(state["step"])
        self._pull_into_params(self.step_count)


def _f32(name: str, t: "torch.Tensor") -> np.ndarray:
    if t.dtype != torch.float32:
        raise TypeError(f"gradient of {name!r} is {t.dtype}, expected float32")
    return t.detach().contiguous().numpy()
