"""The same PyTorch model trained three ways on this machine, one after another in
alternating rounds, 2 workers each: Ibex (`ibex.torch.DistributedOptimizer`, PS processes on
shm via `launch_local`), DDP over gloo, and a `torch.distributed.rpc` parameter server (the
batch-updating PS of PyTorch's RPC tutorial). Prints worker 0's steps/s and the ratios.

    python python/bench/torch_side_by_side.py [--models digits,mlp25m --rounds 2 --ps 2]

Every system runs synchronous momentum SGD (lr 0.05, momentum 0.9) on the same model, data
and per-worker batch, with one torch thread per process. A run's figure is 1 / the median
step time of worker 0 after its warm-up steps; a system's figure is the median over
rounds. Rounds run the systems in alternating order, so drift on a shared machine hits
each. torch is optional: without it this says so and exits 0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

MODELS = {
    # name: (layer widths, per-worker batch, warm-up steps, timed steps)
    "digits": ([64, 64, 10], 32, 60, 300),
    # 1024 -> 6 x 2048 -> 10: 27.3 M parameters (each matrix 16 MiB).
    "mlp25m": ([1024] + [2048] * 7 + [10], 64, 12, 30),
}
LR, MOMENTUM = 0.05, 0.9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(model: str):
    import torch

    widths = MODELS[model][0]
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batches(model: str, rank: int, steps: int):
    """`steps` (x, y) minibatches of this worker's share: the digits, or synthetic data."""
    import numpy as np
    import torch

    widths, per_worker, _, _ = MODELS[model]
    if model == "digits":
        from numpy_digits import load_digits

        x, y = load_digits()
        x, y = torch.from_numpy(x), torch.from_numpy(y).long()
    else:
        g = np.random.default_rng(7)
        x = torch.from_numpy(g.standard_normal((1024, widths[0]), dtype=np.float32))
        y = torch.from_numpy(g.integers(0, widths[-1], 1024)).long()
    n = len(x)
    out = []
    for s in range(steps):
        at = (s * per_worker * 2 + rank * per_worker) % (n - per_worker)
        out.append((x[at : at + per_worker], y[at : at + per_worker]))
    return out


def sgd_step(net, opt):
    """One training step of `net` with `opt`, the same for every system that has an
    optimizer on the worker."""
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    return step


def train(model, step_fn, data) -> List[float]:
    """Runs `step_fn(x, y)` over `data`, returning each step's seconds."""
    times = []
    for x, y in data:
        t0 = time.perf_counter()
        step_fn(x, y)
        times.append(time.perf_counter() - t0)
    return times


# --- Ibex -------------------------------------------------------------------------------


def ibex_worker(rank: int, spec_path: str, model: str, overlap, q) -> None:
    import torch

    import ibex
    import ibex.torch

    torch.set_num_threads(1)
    _, _, warm, timed = MODELS[model]
    net = build(model)
    w = ibex.Worker.connect(cluster=spec_path, index=rank)
    opt = ibex.torch.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM), net.named_parameters(), w,
        overlap=overlap,
    )
    step = sgd_step(net, opt)
    t = train(net, step, batches(model, rank, warm + timed))
    if rank == 0:
        q.put({"times": t[warm:], "overlap": opt.overlap_chosen})


def spawn_and_collect(target, procs: int, args: tuple, join_secs: float) -> Dict:
    """Starts `procs` processes of `target(rank, *args, queue)` and returns what rank 0 puts
    on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, *args, q)) for r in range(procs)]
    for p in ps:
        p.start()
    r = q.get(timeout=900)
    for p in ps:
        p.join(join_secs)
    return r


def run_ibex(model: str, num_ps: int, overlap) -> Dict:
    import ibex

    with ibex.launch_local(num_ps, 2, transport="shm") as cluster:
        return spawn_and_collect(ibex_worker, 2, (cluster.spec_path, model, overlap), 60)


# --- DDP over gloo ------------------------------------------------------------------------


def ddp_worker(rank: int, port: int, model: str, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _, _, warm, timed = MODELS[model]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = torch.nn.parallel.DistributedDataParallel(build(model))
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    step = sgd_step(net, opt)
    t = train(net, step, batches(model, rank, warm + timed))
    if rank == 0:
        q.put({"times": t[warm:]})
    dist.destroy_process_group()


def run_ddp(model: str) -> Dict:
    return spawn_and_collect(ddp_worker, 2, (free_port(), model), 60)


# --- torch.distributed.rpc parameter server (PyTorch's batch-updating PS tutorial) --------


def _async_execution(fn):
    """`rpc.functions.async_execution` where torch is installed: the reply waits for the
    returned future (the step every worker joins) without holding an RPC thread."""
    try:
        from torch.distributed.rpc.functions import async_execution
    except ImportError:
        return fn
    return async_execution(fn)


class BatchUpdateParameterServer:
    """Holds the model; applies one optimizer step once every worker sent its gradients,
    then answers all of them with the fresh model."""

    def __init__(self, model: str, num_workers: int):
        import threading

        import torch

        self.model = build(model)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.num_workers = num_workers
        self.pending = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @_async_execution
    def update_and_fetch_model(ps_rref, grads):
        import torch

        self = ps_rref.local_value()
        with self.lock:
            self.pending += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.pending >= self.num_workers:
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.grad /= self.num_workers
                self.pending = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def rpc_trainer(ps_rref, model: str, rank: int) -> List[float]:
    """Runs on trainer `rank` (started by the PS, as in the tutorial): gradients to the PS,
    the fresh model back, every step."""
    import torch
    import torch.distributed.rpc as rpc

    _, _, warm, timed = MODELS[model]
    holder = {"net": ps_rref.rpc_sync().get_model()}
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        m = holder["net"]
        m.zero_grad()
        loss_fn(m(x), y).backward()
        holder["net"] = rpc.rpc_sync(
            ps_rref.owner(),
            BatchUpdateParameterServer.update_and_fetch_model,
            args=(ps_rref, [p.grad for p in m.parameters()]),
        )

    return train(None, step, batches(model, rank, warm + timed))[warm:]


def rpc_proc(rank: int, port: int, model: str, q) -> None:
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=600)
    name = "ps" if rank == 0 else f"trainer{rank - 1}"
    rpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=opts)
    if rank == 0:
        ps_rref = rpc.RRef(BatchUpdateParameterServer(model, 2))
        futs = [rpc.rpc_async(f"trainer{i}", rpc_trainer, args=(ps_rref, model, i)) for i in range(2)]
        times = [f.wait() for f in futs]
        q.put({"times": times[0]})
    rpc.shutdown()


def run_rpc(model: str) -> Dict:
    return spawn_and_collect(rpc_proc, 3, (free_port(), model), 120)


# --- no communication: the ceiling ---------------------------------------------------------


def local_worker(rank: int, model: str, q) -> None:
    """Trains alone on its share, exchanging nothing: two of these side by side are what
    the machine's cores allow any 2-worker system."""
    import torch

    torch.set_num_threads(1)
    _, _, warm, timed = MODELS[model]
    net = build(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    step = sgd_step(net, opt)
    t = train(net, step, batches(model, rank, warm + timed))
    if rank == 0:
        q.put({"times": t[warm:]})


def run_local(model: str) -> Dict:
    return spawn_and_collect(local_worker, 2, (model,), 60)


# --- the comparison -----------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="digits,mlp25m", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ps", type=int, default=2, help="Ibex PS processes")
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                    help="DistributedOptimizer(overlap=...) for Ibex")
    ap.add_argument("--systems", default="ibex,ddp,rpc",
                    help="any of ibex, ddp, rpc, and local (2 workers that exchange nothing: "
                         "the ceiling this machine's cores set for any 2-worker system)")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: skipped (pip install torch, CPU wheel, to run it)")
        return 0
    import ibex._native

    if ibex._native.debug_build():
        print("warning: a debug build of the extension; timings mean little", file=sys.stderr)
    overlap = {"auto": "auto", "on": True, "off": False}[args.overlap]
    systems = [s for s in args.systems.split(",") if s]
    runners = {
        "ibex": lambda m: run_ibex(m, args.ps, overlap),
        "ddp": run_ddp,
        "rpc": run_rpc,
        "local": run_local,
    }
    print(f"load average at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}; {os.cpu_count()} CPUs; torch {torch.__version__}")
    results: Dict[str, Dict[str, List[float]]] = {}
    for model in args.models.split(","):
        n = sum(p.numel() for p in build(model).parameters())
        print(f"\n{model}: {n / 1e6:.2f} M parameters, 2 workers x batch {MODELS[model][1]}, "
              f"Ibex with {args.ps} PS (overlap={args.overlap})")
        res: Dict[str, List[float]] = {s: [] for s in systems}
        for rnd in range(args.rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            for s in order:
                r = runners[s](model)
                sps = 1.0 / statistics.median(r["times"])
                res[s].append(sps)
                extra = f"  (overlap chosen: {r['overlap']})" if "overlap" in r else ""
                print(f"  round {rnd + 1} {s:5s} {sps:9.2f} steps/s  load "
                      f"{os.getloadavg()[0]:.2f}{extra}", flush=True)
        results[model] = res
        med = {s: statistics.median(v) for s, v in res.items()}
        line = "  median: " + "  ".join(f"{s} {v:.2f}" for s, v in med.items())
        print(line)
        if "ibex" in med:
            for s in systems:
                if s != "ibex":
                    per_round = [a / b for a, b in zip(res["ibex"], res[s])]
                    print(f"  ibex / {s}: {med['ibex'] / med[s]:.2f}x  (per round: "
                          + ", ".join(f"{x:.2f}" for x in per_round) + ")")
        if "local" in med:
            for s in systems:
                if s != "local":
                    print(f"  ceiling: local / {s}: {med['local'] / med[s]:.2f}x  (the most a "
                          f"2-worker system can be over {s} on these cores)")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
