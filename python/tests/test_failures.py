"""Bounded waits from Python: connect and call timeouts as parameters, Ctrl-C that
interrupts a blocked connect or step, and errors that cross process boundaries."""

import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ibex


class Silent:
    """A TCP listener that accepts and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            self.accepted.set()

    def spec(self):
        return ibex.ClusterSpec.from_toml(
            "[cluster]\n"
            f'ps = ["127.0.0.1:{self.port}"]\n'
            'workers = ["127.0.0.1:1"]\n'
            'transport = "tcp"\n'
        )

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent():
    s = Silent()
    yield s
    s.close()


def test_connect_timeout_is_a_parameter_and_names_the_setting(silent):
    t0 = time.monotonic()
    with pytest.raises(ibex.DeadlineError) as e:
        ibex.Worker.connect(silent.spec(), 0, connect_timeout=1.0)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert f"127.0.0.1:{silent.port}" in msg and "connect" in msg and "connect_timeout" in msg, msg
    assert 0.9 <= took < 5, took
    assert isinstance(e.value, ibex.IbexError)


def test_timeouts_follow_the_sync_timeout_unless_given(silent):
    t = silent.spec().with_timeouts(sync=4).timeouts
    assert (t["sync"], t["connect"], t["call"], t["keepalive"]) == (4.0, 4.0, 14.0, 3.0)
    t = silent.spec().with_timeouts(sync=4, call=0.5, keepalive=0).timeouts
    assert (t["call"], t["keepalive"]) == (0.5, None)
    with pytest.raises(ibex.SpecError, match="call_timeout"):
        silent.spec().with_timeouts(call=0)


def test_call_timeout_bounds_a_step_on_a_ps_that_waits(launch):
    # Two workers in the PS's sync step, one present: the step cannot complete, and the
    # call deadline (below the PS's 10 s sync timeout) ends it.
    c = launch(1, 2)
    w = ibex.Worker.connect(c, 0, call_timeout=1.0)
    w.create_variables([ibex.Variable("v", (4,), optimizer=ibex.SGD(0.1))])
    t0 = time.monotonic()
    with pytest.raises(ibex.DeadlineError) as e:
        w.push_pull(0, {"v": np.ones(4, np.float32)})
    took = time.monotonic() - t0
    assert "PushPull" in str(e.value) and "call_timeout" in str(e.value), str(e.value)
    assert 0.9 <= took < 4, took


# Runs in a child: a timer thread sends SIGINT to the process after `delay` while the main
# thread is blocked in `call`; prints how long the KeyboardInterrupt took to arrive.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import numpy as np
    import ibex
    sent = []
    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
    {setup}
    threading.Timer(0.5, interrupt).start()
    t0 = time.monotonic()
    try:
        {call}
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic() - sent[0], time.monotonic() - t0, flush=True)
    """
)


def run_child(setup, call):
    src = CHILD.format(setup=setup, call=call)
    out = subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=60
    )
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert line.startswith("interrupted"), out.stdout + out.stderr
    after_signal, blocked_for = map(float, line.split()[1:])
    return after_signal, blocked_for


def test_ctrl_c_interrupts_a_blocked_connect(silent):
    setup = (
        "spec = ibex.ClusterSpec.from_toml("
        f"'[cluster]\\nps = [\"127.0.0.1:{silent.port}\"]\\nworkers = [\"127.0.0.1:1\"]\\ntransport = \"tcp\"\\n')"
    )
    after, blocked = run_child(setup, "ibex.Worker.connect(spec, 0, connect_timeout=30)")
    print(f"connect: KeyboardInterrupt {after * 1000:.0f} ms after SIGINT")
    assert blocked >= 0.4, "the connect ended before the signal"
    assert after < 0.3, after


def test_ctrl_c_interrupts_a_blocked_step(launch):
    c = launch(1, 2)
    setup = (
        f"w = ibex.Worker.connect(ibex.ClusterSpec.from_toml({c.spec.to_toml()!r}), 0)\n"
        "w.create_variables([ibex.Variable('v', (4,), optimizer=ibex.SGD(0.1))])"
    )
    after, blocked = run_child(setup, "w.push_pull(0, {'v': np.ones(4, np.float32)})")
    print(f"step: KeyboardInterrupt {after * 1000:.0f} ms after SIGINT")
    assert blocked >= 0.4, "the step ended before the signal"
    assert after < 0.3, after


@pytest.mark.parametrize(
    "cls",
    [
        ibex.IbexError,
        ibex.UnknownVariableError,
        ibex.ShapeMismatchError,
        ibex.StaleStepError,
        ibex.PsTimeoutError,
        ibex.DeadlineError,
        ibex.UnavailableError,
        ibex.RejectedError,
        ibex.BufferBusyError,
        ibex.SpecError,
    ],
)
def test_errors_pickle_with_module_ibex(cls):
    assert cls.__module__ == "ibex"
    e = cls("PS 0 at tcp://h:1: Stats got no answer within 2s")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e)


def _raise_unavailable(spec_toml):
    ibex.Worker.connect(ibex.ClusterSpec.from_toml(spec_toml), 0, connect_timeout=0.5)


def test_an_error_crosses_a_process_pool(silent):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    toml = silent.spec().to_toml()
    # spawn: a forked child inherits Ibex's runtime without its threads (docs/python.md).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        with pytest.raises(ibex.DeadlineError, match="connect_timeout"):
            pool.submit(_raise_unavailable, toml).result(timeout=60)


def _connect_in_child(spec_toml):
    ibex.Worker.connect(ibex.ClusterSpec.from_toml(spec_toml), 0, connect_timeout=0.5)


def test_a_child_forked_after_ibex_was_used_is_told_to_spawn(silent):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with pytest.raises(ibex.DeadlineError):
        ibex.Worker.connect(silent.spec(), 0, connect_timeout=0.2)
    toml = silent.spec().to_toml()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        with pytest.raises(ibex.IbexError, match="spawn"):
            pool.submit(_connect_in_child, toml).result(timeout=60)
