"""A push of a 16 MiB float32 array from Python against the same push from Rust, side by
side in one run (docs/benchmarks.md, "Python worker").

    python python/bench/push_16m.py [--rounds 10 --iters 10 --ps 2 --transport shm]

Both sides drive the same `ibex_worker::Worker` (same PS, same connections, same
registered buffers): the Python loop calls `Worker.push(step, {"g": array})` with a NumPy
array, the Rust loop (`ibex._native.bench_rust_push`) calls `Worker::push` with a Vec<f32>
and times each push in Rust. Rounds alternate, so drift on a shared machine hits both;
the ratio is of the medians. `staged` times `stage` + `push_staged` from Python (the
gradient written in place beforehand, nothing copied on the worker), for reference.
Needs a release build of the extension (maturin build --release).
"""

import argparse
import statistics
import sys
import time

import numpy as np

import ibex
from ibex import _native

MIB16 = 16 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10, help="pushes per round and side")
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp", "grpc"])
    args = ap.parse_args(argv)
    if _native.debug_build():
        print("warning: this is a debug build of the extension; timings mean little", file=sys.stderr)
    n = MIB16 // 4
    with ibex.launch_local(args.ps, 1, transport=args.transport) as cluster:
        w = ibex.Worker.connect(cluster=cluster, index=0)
        w.create_variables([ibex.Variable("g", (n,), "zeros", ibex.SGD(1e-6))])
        grad = (np.arange(n, dtype=np.float32) % 1000) * np.float32(1e-6)
        step = 0
        # Warm-up: registered buffers, connections, the PS's buffer pool.
        for _ in range(3):
            w.push(step, {"g": grad})
            step += 1
        t = _native.bench_rust_push(w._w, "g", step, 3)
        step += 3
        py, rs, staged = [], [], []
        for _ in range(args.rounds):
            for _ in range(args.iters):
                t0 = time.perf_counter()
                w.push(step, {"g": grad})
                py.append(time.perf_counter() - t0)
                step += 1
            rs += _native.bench_rust_push(w._w, "g", step, args.iters)
            step += args.iters
            for _ in range(args.iters):
                s = w.stage(["g"])
                t0 = time.perf_counter()
                w.push_staged(step, s)
                staged.append(time.perf_counter() - t0)
                step += 1
        assert w.current_step() == step
    mp, mr, ms = (statistics.median(x) for x in (py, rs, staged))
    print(f"16 MiB float32 push, {args.ps} PS over {args.transport}, "
          f"{args.rounds} rounds x {args.iters} pushes per side (median per push)")
    print(f"  Rust   Worker::push(&[f32])         {mr * 1e3:8.2f} ms  {MIB16 / mr / 1e9:6.2f} GB/s")
    print(f"  Python Worker.push(numpy array)     {mp * 1e3:8.2f} ms  {MIB16 / mp / 1e9:6.2f} GB/s")
    print(f"  Python push_staged (written in place) {ms * 1e3:6.2f} ms  {MIB16 / ms / 1e9:6.2f} GB/s")
    ratio = mp / mr
    print(f"  Python / Rust = {ratio:.3f}x (bar <= 1.2x: {'pass' if ratio <= 1.2 else 'FAIL'})")
    return 0 if ratio <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
