"""PyTorch on Ibex parameter servers, in the style of Horovod's and BytePS's
`DistributedOptimizer`:

    import ibex, ibex.torch
    worker = ibex.Worker.connect(cluster="cluster.toml", index=rank)
    optimizer = ibex.torch.DistributedOptimizer(optimizer, model.named_parameters(), worker)

The wrapped optimizer's kind and hyper-parameters (SGD with or without momentum, Adagrad,
Adam) become the PS's optimizer: the PS applies the update, so the local optimizer never
steps. Each parameter is pushed from a gradient hook as soon as backward has accumulated
its gradient, so pushes of later layers overlap the backward pass of earlier ones;
`step()` pushes what is left, waits, and pulls the fresh weights straight into the
parameters' memory before the next forward pass. Sync or async is the PS's `--mode`
(`launch_local(mode=...)`): in sync mode the PS averages the workers' gradients once per
step; in async mode every push is applied on arrival and pulls never wait.

Import it only where torch is installed: `import ibex` never imports torch.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

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


class DistributedOptimizer:
    """Wraps `optimizer` so that `step()` trains through the parameter servers of
    `worker` (see the module docstring). `named_parameters` names the PS variables
    (prefixed by `prefix`); every worker must pass the same model. `init(name, param)`
    picks each variable's PS initializer (default: Glorot-uniform for matrices and
    kernels, zeros for vectors); the PS values replace the local ones at construction.
    `overlap=False` pushes everything in `step()` instead of from the hooks."""

    def __init__(
        self,
        optimizer: "torch.optim.Optimizer",
        named_parameters: Iterable[Tuple[str, "torch.nn.Parameter"]],
        worker: "ibex.Worker",
        *,
        prefix: str = "",
        init: Callable = _default_init,
        seed: int = 0,
        overlap: bool = True,
        start_step: int = 0,
    ):
        self.optimizer = optimizer
        self.worker = worker
        self.overlap = overlap
        self.step_count = start_step
        self._params: List[Tuple[str, torch.nn.Parameter]] = []
        seen = set()
        for name, p in named_parameters:
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
        self._hooks = []
        if overlap:
            for name, p in self._params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(name)))
        # Pull the PS's values (the step this job is at) into the parameters.
        self._pull_into_params(self.step_count)

    def _hook(self, name: str):
        def hook(p: "torch.Tensor") -> None:
            if p.grad is None or self._pushed.get(name):
                return
            if self._step_push is None:
                self._step_push = self.worker.begin_step(self.step_count)
            # StepPush copies the gradient once and sends it in the background, so the
            # backward pass goes on with the next layer while this one is on the wire.
            self._step_push.push({name: _f32(name, p.grad)})
            self._pushed[name] = True

        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Pushes the gradients not yet pushed (zeros for parameters that got none, since
        a sync step needs every variable), waits for the step and pulls the new weights
        into the parameters. Returns the closure's loss, if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sp = self._step_push or self.worker.begin_step(self.step_count)
        rest = {}
        for name, p in self._params:
            if self._pushed.get(name):
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            rest[name] = _f32(name, g)
        if rest:
            sp.push(rest)
        out = [p.detach().numpy() for _, p in self._params]
        try:
            sp.finish_pull(self._names, out=out)
        finally:
            self._step_push = None
            self._pushed = {}
        self.step_count += 1
        return loss

    def _pull_into_params(self, step: int) -> None:
        with torch.no_grad():
            self.worker.pull(self._names, step, out=[p.detach().numpy() for _, p in self._params])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return {"step": self.step_count}

    def load_state_dict(self, state) -> None:
        self.step_count = int(state["step"])
        self._pull_into_params(self.step_count)


def _f32(name: str, t: "torch.Tensor"):
    if t.dtype != torch.float32:
        raise TypeError(f"gradient of {name!r} is {t.dtype}, expected float32")
    return t.detach().contiguous().numpy()
