"""Parameter-server training of a small MLP on the UCI digits with NumPy only: 2 PS and 2
worker processes over Ibex shm, as `ibex demo` runs it (docs/demo.md).

    python python/examples/numpy_digits.py            # prints loss, accuracy, steps/s, comm profile

The model is 64 -> hidden (ReLU) -> 10 with softmax cross-entropy; the four variables live
on the PS, which apply momentum SGD to the average of the workers' gradients. Each step a
worker computes the mean gradient over its share of the minibatch straight into Ibex's
registered buffers (`Worker.stage`: NumPy views, nothing copied on the worker) and pushes
them; `--path push_pull` passes ordinary arrays instead, `--path overlap` pushes each layer
as soon as its gradient is ready. Exits with status 1 below 90% test accuracy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np

import ibex

HERE = os.path.dirname(os.path.abspath(__file__))
DIGITS = os.path.join(HERE, "..", "..", "data", "digits", "digits.csv.gz")
NAMES = ["dense1/kernel", "dense1/bias", "dense2/kernel", "dense2/bias"]


def load_digits(path: str = DIGITS):
    """(pixels scaled to [0, 1] as float32 [n, 64], labels int64 [n])."""
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return raw[:, :64] / 16.0, raw[:, 64].astype(np.int64)


def split(x, y, seed: int, test_size: int):
    perm = np.random.default_rng(seed).permutation(len(x))
    test, train = perm[:test_size], perm[test_size:]
    return (x[train], y[train]), (x[test], y[test])


def variables(hidden: int, lr: float, momentum: float, seed: int):
    opt = ibex.Momentum(lr, momentum) if momentum > 0 else ibex.SGD(lr)
    return [
        ibex.Variable("dense1/kernel", (64, hidden), "glorot_uniform", opt, seed=seed),
        ibex.Variable("dense1/bias", (hidden,), "zeros", opt),
        ibex.Variable("dense2/kernel", (hidden, 10), "glorot_uniform", opt, seed=seed + 1),
        ibex.Variable("dense2/bias", (10,), "zeros", opt),
    ]


def forward(params, x):
    w1, b1, w2, b2 = params
    h = np.maximum(x @ w1 + b1, 0.0)
    logits = h @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def accuracy(params, x, y) -> float:
    return float((forward(params, x)[1].argmax(axis=1) == y).mean())


def backward_into(params, x, y, g, layer_done=None) -> float:
    """Mean cross-entropy gradients over (x, y) written into g (four float32 arrays of
    the variables' shapes); calls layer_done(names) as each layer's gradients are ready
    (output layer first). Returns the loss."""
    w1, _, w2, _ = params
    h, p = forward(params, x)
    n = len(x)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1.0
    d /= n
    np.matmul(h.T, d, out=g[2])
    np.sum(d, axis=0, out=g[3])
    if layer_done:
        layer_done([2, 3])
    dh = d @ w2.T
    dh *= h > 0
    np.matmul(x.T, dh, out=g[0])
    np.sum(dh, axis=0, out=g[1])
    if layer_done:
        layer_done([0, 1])
    return loss


def train_worker(args) -> dict:
    """One worker's training loop; worker 0 returns (and prints) the results."""
    x, y = load_digits(args.data)
    (xtr, ytr), (xte, yte) = split(x, y, args.seed, args.test_size)
    share = args.batch // args.workers
    w = ibex.Worker.connect(cluster=args.spec, index=args.index)
    w.create_variables(variables(args.hidden, args.lr, args.momentum, args.seed))
    params = [a.astype(np.float32) for a in w.pull(NAMES, 0)]
    order = np.random.default_rng(args.seed ^ 0x5EED).permutation(len(xtr))
    losses = []
    scratch = [np.empty_like(p) for p in params]
    start = time.perf_counter()
    for step in range(args.steps):
        at = (step * args.batch) % len(xtr)
        idx = np.take(order, range(at, at + args.batch), mode="wrap")
        idx = idx[args.index * share:(args.index + 1) * share]
        xb, yb = xtr[idx], ytr[idx]
        if args.path == "staged":
            # The gradients are computed straight into the registered buffers.
            staged = w.stage(NAMES)
            loss = backward_into(params, xb, yb, [staged.array(n) for n in NAMES])
            w.push_pull_staged(step, staged, out=params)
        elif args.path == "overlap":
            s = w.begin_step(step)
            loss = backward_into(params, xb, yb, scratch,
                                 lambda ks: s.push({NAMES[k]: scratch[k] for k in ks}))
            s.finish_pull(NAMES, out=params)
        else:
            loss = backward_into(params, xb, yb, scratch)
            w.push_pull(step, dict(zip(NAMES, scratch)), out=params)
        losses.append(loss)
        if args.index == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    result = {
        "worker": args.index,
        "losses": losses,
        "test_accuracy": accuracy(params, xte, yte),
        "train_accuracy": accuracy(params, xtr, ytr),
        "steps_per_s": args.steps / elapsed,
        "comm_profile": w.comm_profile(),
        "connection_stats": {str(k): v for k, v in w.connection_stats().items()},
    }
    return result


def run_job(args) -> dict:
    """Starts the PS, runs every worker in its own process, returns worker 0's results."""
    if args.batch % args.workers:
        raise SystemExit(f"--batch {args.batch} does not split evenly over {args.workers} workers")
    with ibex.launch_local(args.ps, args.workers, transport=args.transport) as cluster:
        report = os.path.join(cluster.directory, "worker-0.json")
        base = [sys.executable, os.path.abspath(__file__), "--role", "worker",
                "--spec", cluster.spec_path, "--report", report]
        for k in ("ps", "workers", "steps", "batch", "lr", "momentum", "hidden", "seed",
                  "test_size", "path", "data", "transport"):
            base += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        procs = [subprocess.Popen(base + ["--index", str(i)]) for i in range(args.workers)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"worker exit codes {codes}; PS logs in {cluster.directory}")
        with open(report) as f:
            return json.load(f)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "grpc"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--test-size", type=int, default=300)
    ap.add_argument("--path", default="staged", choices=["staged", "push_pull", "overlap"])
    ap.add_argument("--data", default=DIGITS)
    ap.add_argument("--role", default="job", choices=["job", "worker"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.role == "worker":
        result = train_worker(args)
        if args.index == 0 and args.report:
            with open(args.report, "w") as f:
                json.dump(result, f)
        return 0
    r = run_job(args)
    print(f"test accuracy {r['test_accuracy'] * 100:.1f}% (train {r['train_accuracy'] * 100:.1f}%)")
    print(f"worker 0: {r['steps_per_s']:.0f} steps/s ({args.path}, {args.transport})")
    print(r["comm_profile"])
    if r["test_accuracy"] < 0.9:
        print("FAILED: test accuracy below 90%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
