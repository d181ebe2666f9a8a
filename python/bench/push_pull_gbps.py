"""A synchronous training exchange of ResNet-50's variables from Python against the same
exchange from Rust (`ibex-bench ps-step --fused`), side by side in alternating rounds.

    python python/bench/push_pull_gbps.py [--rounds 2 --steps 20 --ibex-bench target/release/ibex-bench]

Both run 2 worker processes against 2 PS processes over shm in sync mode, with no compute:
every step each worker pushes a gradient for each of ResNet-50's 161 tensors (25.6 M
parameters) and gets every fresh value back in one `push_pull` per PS. The Python workers
call `Worker.push_pull(step, grads, out=values)` with NumPy arrays (the values land in the
same arrays every step, as a framework keeps its parameters); the Rust ones are
`ibex-bench ps-step --fused` (`Worker::push_pull_into`). Effective GB/s is ps-step's:
2 x model bytes x workers x steps/s. Needs a release build of the extension and of
ibex-bench/ibex-ps (`cargo build --release -p ibex-bench -p ibex-ps`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import List, Tuple

import numpy as np

import ibex

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def resnet50() -> List[Tuple[str, Tuple[int, ...]]]:
    """ResNet-50 v1.5's trainable variables in TensorFlow's layouts (convs without bias,
    each followed by batch norm gamma and beta; FC kernel and bias): 161 tensors."""
    v: List[Tuple[str, Tuple[int, ...]]] = []

    def conv_bn(name: str, k: int, cin: int, cout: int) -> None:
        v.append((f"{name}/kernel", (k, k, cin, cout)))
        v.append((f"{name}/bn/gamma", (cout,)))
        v.append((f"{name}/bn/beta", (cout,)))

    conv_bn("conv1", 7, 3, 64)
    cin = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            p = f"stage{stage}/block{b}"
            if b == 0:
                conv_bn(f"{p}/shortcut", 1, cin, width * 4)
            conv_bn(f"{p}/a", 1, cin, width)
            conv_bn(f"{p}/b", 3, width, width)
            conv_bn(f"{p}/c", 1, width, width * 4)
            cin = width * 4
    v.append(("fc/kernel", (2048, 1000)))
    v.append(("fc/bias", (1000,)))
    return v


VARS = resnet50()
PARAMS = sum(int(np.prod(s)) for _, s in VARS)
assert len(VARS) == 161 and PARAMS == 25_557_032, (len(VARS), PARAMS)


def py_worker(index: int, spec_path: str, warmup: int, steps: int, q) -> None:
    w = ibex.Worker.connect(cluster=spec_path, index=index)
    w.create_variables([ibex.Variable(n, s, "zeros", ibex.SGD(1e-6)) for n, s in VARS])
    names = [n for n, _ in VARS]
    grads = [(n, np.full(s, 1e-3, np.float32)) for n, s in VARS]
    values = [np.zeros(s, np.float32) for _, s in VARS]
    step = w.current_step()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        w.push_pull(step, grads, out=values)
        step += 1
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    assert len(names) == len(values)
    q.put((index, times))


def run_python(warmup: int, steps: int) -> float:
    """Steps/s of the slower worker (the job's pace), from each worker's median step."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with ibex.launch_local(2, 2, transport="shm") as c:
        procs = [ctx.Process(target=py_worker, args=(i, c.spec_path, warmup, steps, q)) for i in range(2)]
        for p in procs:
            p.start()
        got = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
    return min(1.0 / statistics.median(t) for _, t in got)


def run_rust(bench: str, warmup: int, steps: int) -> float:
    out = subprocess.run(
        [bench, "ps-step", "--model", "resnet50", "--transport", "ibex-shm", "--workers", "2",
         "--ps", "2", "--fused", "--steps", str(steps), "--warmup-steps", str(warmup), "--json"],
        capture_output=True, text=True, timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"ibex-bench ps-step failed:\n{out.stdout}\n{out.stderr}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return float(rec["rpc_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ibex-bench", default=os.path.join(ROOT, "target", "release", "ibex-bench"))
    args = ap.parse_args(argv)
    if ibex._native.debug_build():
        print("warning: a debug build of the extension; timings mean little", file=sys.stderr)
    if not os.access(args.ibex_bench, os.X_OK):
        raise SystemExit(f"{args.ibex_bench} not found: cargo build --release -p ibex-bench -p ibex-ps")
    gb = 2 * PARAMS * 4 * 2 / 1e9  # GB per step: every worker's pushed and pulled f32
    print(f"ResNet-50 ({len(VARS)} tensors, {PARAMS} parameters), 2 workers, 2 PS, shm, sync; "
          f"load average {os.getloadavg()[0]:.2f}")
    rust: List[float] = []
    py: List[float] = []
    for r in range(args.rounds):
        order = ("rust", "python") if r % 2 == 0 else ("python", "rust")
        for side in order:
            if side == "rust":
                rust.append(run_rust(args.ibex_bench, args.warmup, args.steps))
                v = rust[-1]
            else:
                py.append(run_python(args.warmup, args.steps))
                v = py[-1]
            print(f"  round {r + 1} {side:6s} {v:6.2f} steps/s  {v * gb:6.2f} GB/s effective  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    mr, mp_ = statistics.median(rust), statistics.median(py)
    print(f"  median: Rust ps-step {mr * gb:.2f} GB/s, Python push_pull {mp_ * gb:.2f} GB/s; "
          f"Rust / Python = {mr / mp_:.2f}x (bar <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
