"""Living with the package: errors that cross processes and name the mistake, a
launch_local that cleans up after itself and never outlives its parent, types that mypy
checks, docstrings, and torchrun's environment."""

import importlib
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import ibex

HERE = os.path.dirname(os.path.abspath(__file__))

EXCEPTIONS = [
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
]


def _raise(name, message):
    raise getattr(ibex, name)(message)


def test_every_exception_class_crosses_a_process_pool_with_its_message():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for cls in EXCEPTIONS:
            msg = f"PS 1 at shm://127.0.0.1:9: {cls.__name__} from a child"
            with pytest.raises(cls) as e:
                pool.submit(_raise, cls.__name__, msg).result(timeout=60)
            assert type(e.value) is cls and str(e.value) == msg
            assert isinstance(e.value, ibex.IbexError)


def test_a_variable_pushed_twice_in_an_open_step_is_named(launch):
    w = ibex.Worker.connect(cluster=launch(1), index=0)
    w.create_variables([ibex.Variable("a", (3,)), ibex.Variable("b", (3,))])
    g = np.ones(3, np.float32)
    w.push(0, {"a": g})  # step 0 stays open: "b" is still missing
    with pytest.raises(ibex.StaleStepError) as e:
        w.push(0, {"a": g})
    msg = str(e.value)
    assert 'pushed "a" twice in step 0' in msg and "still open" in msg, msg
    assert "already applied" not in msg, msg
    # The refused push did not count: the step completes with "b".
    w.push(0, {"b": g})
    assert w.current_step() == 1


def test_a_ps_that_dies_mid_run_went_away(launch):
    c = launch(1)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables([ibex.Variable("v", (1024,))])
    w.push_pull(0, {"v": np.ones(1024, np.float32)})
    c.kill_ps(0)
    t = time.monotonic()
    with pytest.raises(ibex.UnavailableError) as e:
        w.push_pull(1, {"v": np.ones(1024, np.float32)})
    assert time.monotonic() - t < 10
    msg = str(e.value)
    assert "went away" in msg and c.spec.ps[0].split(":")[1] in msg, msg
    assert "cannot connect" not in msg.split("(")[0], msg


def test_launch_local_removes_its_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with ibex.launch_local(1, 1, sync_timeout_secs=10) as c:
        d = c.directory
        assert d.startswith(str(tmp_path)) and os.path.isdir(d)
        w = ibex.Worker.connect(cluster=c, index=0)
        w.create_variables([ibex.Variable("v", (8,))])
        w.push_pull(0, {"v": np.ones(8, np.float32)})
    assert not os.path.exists(d)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ibex-local-")]
    # keep=True keeps it, logs and final checkpoint included.
    with ibex.launch_local(1, 1, keep=True, sync_timeout_secs=10) as c:
        kept = c.directory
    assert os.path.isfile(os.path.join(kept, "ps-0.log")) and os.path.isdir(os.path.join(kept, "ckpt"))


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ps_processes_die_with_a_sigkilled_parent(tmp_path):
    src = textwrap.dedent(
        """
        import sys, time, ibex
        c = ibex.launch_local(2, 1, sync_timeout_secs=10)
        print(" ".join(map(str, c.pids)), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids), line
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"PS {pids} outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_mypy_checks_a_typed_example_against_the_stubs(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed: pip install mypy")
    import ibex as pkg

    pkg_dir = os.path.dirname(pkg.__file__)
    assert os.path.isfile(os.path.join(pkg_dir, "py.typed"))
    assert os.path.isfile(os.path.join(pkg_dir, "_native.pyi"))
    cmd = [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
           "--python-executable", sys.executable]
    ok = subprocess.run(cmd + [os.path.join(HERE, "typed_example.py")], capture_output=True,
                        text=True, cwd=str(tmp_path), timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The types are read, not taken as Any: a wrong call is an error.
    bad = tmp_path / "bad.py"
    bad.write_text("import ibex\n"
                   "def f(w: ibex.Worker) -> None:\n"
                   "    w.push_pull('zero', {})\n"
                   "    n: str = w.num_ps\n")
    out = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, cwd=str(tmp_path), timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("error:") == 2, out.stdout
    assert "bad.py:3: error" in out.stdout and "bad.py:4: error" in out.stdout, out.stdout


def test_typed_example_runs(launch):
    import typed_example

    [w] = typed_example.train(launch(1), 3)
    np.testing.assert_array_equal(w.shape, (4, 2))


def _public_methods(cls):
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if callable(member) or isinstance(member, (property, staticmethod, classmethod)):
            yield name, member


def test_every_public_method_has_a_docstring():
    from ibex import _native

    classes = [ibex.Worker, ibex.StepPush, ibex.LocalCluster, ibex.ClusterSpec, ibex.Variable,
               ibex.SGD, ibex.Momentum, ibex.Adagrad, ibex.Adam, _native.Staged]
    try:
        classes.append(importlib.import_module("ibex.torch").DistributedOptimizer)
    except ImportError:
        pass  # no torch here
    missing = []
    for cls in classes:
        if not (cls.__doc__ or "").strip():
            missing.append(cls.__name__)
        for name, m in _public_methods(cls):
            doc = inspect.getdoc(getattr(cls, name))
            if isinstance(m, property):
                doc = m.__doc__
            if not (doc or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    for f in (ibex.launch_local,):
        if not (f.__doc__ or "").strip():
            missing.append(f.__name__)
    assert not missing, f"no docstring: {missing}"


def test_connect_with_no_arguments_under_torchrun(launch, monkeypatch):
    c = launch(2, 2)
    for k in ("TF_CONFIG", "SLURM_PROCID", "IBEX_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("IBEX_PS", ",".join(c.spec.ps))
    monkeypatch.setenv("IBEX_TRANSPORT", c.spec.transport)
    w1 = ibex.Worker.connect()
    assert (w1.index, w1.local_rank, w1.num_ps) == (1, 1, 2)
    assert w1.spec.ps == c.spec.ps and len(w1.spec.workers) == 2
    # Rank 0 of the same job, and a real sync step between the two.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    w0 = ibex.Worker.connect()
    assert w0.index == 0
    for w in (w0, w1):
        w.create_variables([ibex.Variable("v", (4,), "zeros", ibex.SGD(1.0))])
    w0.push(0, {"v": np.full(4, 1.0, np.float32)})
    w1.push(0, {"v": np.full(4, 3.0, np.float32)})
    np.testing.assert_array_equal(w0.pull(["v"], 1)[0], np.full(4, -2.0, np.float32))
    # A spec file instead of IBEX_PS.
    monkeypatch.delenv("IBEX_PS")
    monkeypatch.setenv("IBEX_CLUSTER", c.spec_path)
    assert ibex.Worker.connect().index == 0
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ibex.SpecError, match="WORLD_SIZE=3"):
        ibex.Worker.connect()
    # Neither: say what to set.
    monkeypatch.delenv("IBEX_CLUSTER")
    with pytest.raises(ibex.SpecError, match="IBEX_PS"):
        ibex.Worker.connect()


def test_parameters_instead_of_named_parameters_is_a_clear_type_error(launch):
    torch = pytest.importorskip("torch")
    import ibex.torch

    w = ibex.Worker.connect(cluster=launch(1), index=0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"named_parameters\(\) instead of model.parameters\(\)"):
        ibex.torch.DistributedOptimizer(opt, m.parameters(), w)
    with pytest.raises(TypeError, match="named_parameters"):
        ibex.torch.DistributedOptimizer(opt, m.weight, w)
