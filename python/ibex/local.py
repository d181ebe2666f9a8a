"""`launch_local`: parameter servers as child processes of this one, for notebooks, tests
and single-host jobs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from . import _native


def _free_ports(n: int) -> List[int]:
    """Ports the kernel hands out now; over shm they only name the socket file."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class LocalCluster:
    """PS processes started by `launch_local`; pass it as `Worker.connect(cluster=...)`.
    `stop()` (or leaving a `with` block) sends SIGTERM, so each PS writes its final
    checkpoint when it has a checkpoint directory."""

    def __init__(self, spec: "_native.Spec", directory: str, procs, logs: List[str]):
        self.spec = spec
        self.directory = directory
        self.spec_path = os.path.join(directory, "cluster.toml")
        self.procs = procs
        self.logs = logs

    @property
    def num_ps(self) -> int:
        return len(self.procs)

    def kill_ps(self, i: int) -> None:
        """SIGKILLs PS `i` (for failure tests)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def stop(self, timeout: float = 10.0) -> List[Optional[int]]:
        """Stops every PS (SIGTERM, then SIGKILL after `timeout`); returns exit codes."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        # A forgotten cluster must not outlive the interpreter as orphan processes.
        for p in getattr(self, "procs", []):
            if p.poll() is None:
                p.kill()


def launch_local(
    num_ps: int,
    num_workers: int = 1,
    *,
    mode: str = "sync",
    transport: str = "shm",
    directory: Optional[str] = None,
    checkpoint_every: int = 0,
    sync_timeout_secs: int = 30,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 30.0,
) -> LocalCluster:
    """Starts `num_ps` PS shards (`python -m ibex.ps`) on this host for `num_workers`
    workers and returns once each serves. `transport`: shm, tcp or grpc. Checkpoints go
    to `directory`/ckpt when `checkpoint_every` > 0 (or on stop). PS logs:
    `directory`/ps-<i>.log."""
    if num_ps < 1 or num_workers < 1:
        raise ValueError("launch_local needs at least one PS and one worker")
    directory = directory or tempfile.mkdtemp(prefix="ibex-local-")
    os.makedirs(directory, exist_ok=True)
    ports = _free_ports(num_ps + num_workers)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    toml = (
        "[cluster]\n"
        f"ps = {json.dumps(addrs[:num_ps])}\n"  # a JSON list of strings is TOML too
        f"workers = {json.dumps(addrs[num_ps:])}\n"
        f'transport = "{transport}"\n'
        f"sync_timeout_secs = {float(sync_timeout_secs)}\n"
    )
    spec = _native.Spec.from_toml(toml)
    with open(os.path.join(directory, "cluster.toml"), "w") as f:
        f.write(toml)
    ckpt = os.path.join(directory, "ckpt")
    procs, logs = [], []
    try:
        for i in range(num_ps):
            log = os.path.join(directory, f"ps-{i}.log")
            args = [
                sys.executable, "-m", "ibex.ps",
                "--listen", spec.ps_listen_uri(i),
                "--shard", str(i),
                "--num-workers", str(num_workers),
                "--mode", mode,
                "--checkpoint-dir", ckpt,
                "--checkpoint-every", str(checkpoint_every),
                "--sync-timeout-secs", str(sync_timeout_secs),
                *extra_args,
            ]
            with open(log, "w") as out:
                procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT))
            logs.append(log)
        cluster = LocalCluster(spec, directory, procs, logs)
        _wait_serving(cluster, ready_timeout)
        return cluster
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        raise


def _wait_serving(cluster: LocalCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(cluster.num_ps))
    while pending:
        for i in sorted(pending):
            if "serving on" in cluster.log(i):
                pending.discard(i)
            elif cluster.procs[i].poll() is not None:
                raise _native.IbexError(
                    f"PS {i} exited with status {cluster.procs[i].returncode} before serving:\n"
                    + cluster.log(i)
                )
        if pending and time.monotonic() > deadline:
            raise _native.IbexError(
                f"PS {sorted(pending)} not serving after {timeout}s; logs in {cluster.directory}"
            )
        if pending:
            time.sleep(0.02)
