"""`launch_local`: parameter servers as child processes of this one, for notebooks, tests
and single-host jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, List, Optional, Sequence

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
    checkpoint when it has a checkpoint directory, and removes the directory that
    `launch_local` created unless it was asked to keep it. The PS processes also exit
    when this process dies, however it dies."""

    def __init__(
        self,
        spec: "_native.Spec",
        directory: str,
        procs: "List[subprocess.Popen[bytes]]",
        logs: List[str],
        *,
        remove_directory: bool = False,
    ):
        self.spec = spec
        self.directory = directory
        self.spec_path = os.path.join(directory, "cluster.toml")
        self.procs = procs
        self.logs = logs
        self._remove_directory = remove_directory

    @property
    def num_ps(self) -> int:
        """Number of PS processes."""
        return len(self.procs)

    @property
    def pids(self) -> List[int]:
        """The PS processes' ids, in shard order."""
        return [p.pid for p in self.procs]

    def kill_ps(self, i: int) -> None:
        """SIGKILLs PS `i` (for failure tests)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def stop(self, timeout: float = 10.0) -> List[Optional[int]]:
        """Stops every PS (SIGTERM, then SIGKILL after `timeout`); returns exit codes. Then
        removes the cluster's directory if `launch_local` created it and was not asked to
        keep it."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes: List[Optional[int]] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
            _close_stdin(p)
        if self._remove_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._remove_directory = False
        return codes

    def log(self, i: int) -> str:
        """PS `i`'s log so far (its stdout and stderr)."""
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        # A forgotten cluster must not outlive the interpreter as orphan processes.
        for p in getattr(self, "procs", []):
            if p.poll() is None:
                p.kill()
            _close_stdin(p)
        if getattr(self, "_remove_directory", False):
            shutil.rmtree(self.directory, ignore_errors=True)


def _close_stdin(p: "subprocess.Popen[bytes]") -> None:
    stdin: Optional[IO[bytes]] = p.stdin
    if stdin is not None:
        try:
            stdin.close()
        except OSError:
            pass


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
    keep: bool = False,
) -> LocalCluster:
    """Starts `num_ps` PS shards (`python -m ibex.ps`) on this host for `num_workers`
    workers and returns once each serves. `transport`: shm, tcp or grpc. PS logs:
    `directory`/ps-<i>.log, the spec `directory`/cluster.toml.

    Without `directory`, the cluster lives in a new temporary directory that `stop()`
    removes, logs included, unless `keep` is true; the PS then checkpoint only when
    `checkpoint_every` > 0 (or `keep`). With `directory` (kept), checkpoints go to
    `directory`/ckpt every `checkpoint_every` steps and on stop.

    The PS processes exit when this process exits or dies, even by SIGKILL: each watches
    a pipe from this process and stops (as on SIGTERM) when it closes."""
    if num_ps < 1 or num_workers < 1:
        raise ValueError("launch_local needs at least one PS and one worker")
    remove = directory is None and not keep
    checkpoints = not remove or checkpoint_every > 0
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
                *(["--checkpoint-dir", ckpt] if checkpoints else []),
                "--checkpoint-every", str(checkpoint_every),
                "--sync-timeout-secs", str(sync_timeout_secs),
                *extra_args,
            ]
            env = dict(os.environ, IBEX_PS_EXIT_WITH_STDIN="1")
            with open(log, "w") as out:
                # stdin is a pipe only this process writes: when it dies, the PS reads EOF
                # and stops (python/ibex/ps.py).
                procs.append(
                    subprocess.Popen(
                        args, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env
                    )
                )
            logs.append(log)
        cluster = LocalCluster(spec, directory, procs, logs, remove_directory=remove)
        _wait_serving(cluster, ready_timeout)
        return cluster
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            _close_stdin(p)
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
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
            logs = "\n".join(f"--- PS {i}:\n{cluster.log(i)}" for i in sorted(pending))
            raise _native.IbexError(
                f"PS {sorted(pending)} not serving after {timeout}s (raise ready_timeout on a "
                f"busy machine); their logs:\n{logs}"
            )
        if pending:
            time.sleep(0.02)
