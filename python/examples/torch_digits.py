"""PyTorch training through Ibex parameter servers: an MLP on the UCI digits, 2 PS and 2
worker processes over shm, with `ibex.torch.DistributedOptimizer` (the two-line switch):

    python python/examples/torch_digits.py          # needs torch; prints loss, accuracy, steps/s, comm profile

Each worker runs an ordinary PyTorch loop (forward, loss, backward, optimizer.step) on
its share of each minibatch. Each gradient is copied once into Ibex's registered buffers
and pushed from its hook during backward or with the others in `step()`, whichever the
optimizer measured faster; `step()` reads the PS's fresh weights into the model. Exits with status 1
below 90% test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

import ibex
import ibex.torch
from numpy_digits import DIGITS, load_digits, split


def model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


def train_worker(args) -> dict:
    torch.set_num_threads(1)  # one core per worker process; the PS need the others
    x, y = load_digits(args.data)
    (xtr, ytr), (xte, yte) = split(x, y, args.seed, args.test_size)
    xtr, ytr, xte, yte = map(torch.from_numpy, (xtr, ytr, xte, yte))
    share = args.batch // args.workers
    net = model(args.hidden)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    # The two lines that move a PyTorch script onto Ibex parameter servers:
    worker = ibex.Worker.connect(cluster=args.spec, index=args.index)
    optimizer = ibex.torch.DistributedOptimizer(
        optimizer, net.named_parameters(), worker, seed=args.seed,
        overlap=False if args.no_overlap else "auto",
    )
    order = torch.from_numpy(np.random.default_rng(args.seed ^ 0x5EED).permutation(len(xtr)))
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        at = (step * args.batch) % len(xtr)
        idx = order[(torch.arange(at, at + args.batch) % len(xtr))]
        idx = idx[args.index * share:(args.index + 1) * share]
        optimizer.zero_grad()
        loss = loss_fn(net(xtr[idx]), ytr[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if args.index == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        acc = (net(xte).argmax(dim=1) == yte).float().mean().item()
    return {
        "losses": losses,
        "test_accuracy": acc,
        "steps_per_s": args.steps / elapsed,
        "comm_profile": worker.comm_profile(),
        "mode": worker.stats()[0]["mode"],
        "overlap": optimizer.overlap_chosen,
    }


def run_job(args) -> dict:
    if args.batch % args.workers:
        raise SystemExit(f"--batch {args.batch} does not split evenly over {args.workers} workers")
    with ibex.launch_local(args.ps, args.workers, mode=args.mode, transport=args.transport) as c:
        report = os.path.join(c.directory, "worker-0.json")
        base = [sys.executable, os.path.abspath(__file__), "--role", "worker",
                "--spec", c.spec_path, "--report", report]
        for k in ("ps", "workers", "steps", "batch", "lr", "momentum", "hidden", "seed",
                  "test_size", "data", "transport", "mode"):
            base += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        if args.no_overlap:
            base.append("--no-overlap")
        procs = [subprocess.Popen(base + ["--index", str(i)]) for i in range(args.workers)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"worker exit codes {codes}; PS logs in {c.directory}")
        with open(report) as f:
            return json.load(f)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "grpc"])
    ap.add_argument("--mode", default="sync", choices=["sync", "async"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--test-size", type=int, default=300)
    ap.add_argument("--no-overlap", action="store_true",
                    help="push every layer in step() (default: whichever is measured faster)")
    ap.add_argument("--data", default=DIGITS)
    ap.add_argument("--role", default="job", choices=["job", "worker"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.role == "worker":
        r = train_worker(args)
        if args.index == 0 and args.report:
            with open(args.report, "w") as f:
                json.dump(r, f)
        return 0
    r = run_job(args)
    print(f"test accuracy {r['test_accuracy'] * 100:.1f}%")
    print(f"worker 0: {r['steps_per_s']:.0f} steps/s ({r['mode']}, {args.transport}, "
          f"{'per-layer pushes from gradient hooks' if r['overlap'] else 'one push per step'})")
    print(r["comm_profile"])
    if r["test_accuracy"] < 0.9:
        print("FAILED: test accuracy below 90%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
