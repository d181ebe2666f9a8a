"""The worker API over NumPy: round trips bit for bit, zero copy, per-layer pushes,
sparse tables, checkpoints, cluster specs, the GIL."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ibex
from ibex import _native

# 600 x 1024 float32 = 2.4 MiB: split into 3 parts over the PS, each >= 256 KiB, so its
# pushes and pulls go one-sided over shm; "small" stays inline.
BIG = (600, 1024)
SMALL = (3, 5)


def awkward(rng, shape):
    """Gradients with values whose bits an encoding slip would change: subnormals, -0.0,
    large and tiny magnitudes."""
    g = rng.standard_normal(shape).astype(np.float32)
    flat = g.reshape(-1)
    flat[:4] = [np.float32(1e-45), np.float32(-0.0), np.float32(3e38), np.float32(-1e-38)]
    return g


def variables(opt):
    return [
        ibex.Variable("small", SMALL, ("normal", 0.5), opt, seed=3),
        ibex.Variable("big", BIG, ("normal", 0.1), opt, seed=4),
    ]


def test_round_trip_bit_for_bit_against_the_rust_worker_and_numpy(launch):
    rng = np.random.default_rng(7)
    steps = [{n: awkward(rng, s) for n, s in (("small", SMALL), ("big", BIG))} for _ in range(3)]
    lr = 0.125
    py = ibex.Worker.connect(cluster=launch(2), index=0)
    rs = ibex.Worker.connect(cluster=launch(2), index=0)
    for w in (py, rs):
        w.create_variables(variables(ibex.SGD(lr)))
    assert len(py.placement("big")) == 3
    start = py.pull(["small", "big"], 0)
    for a, b in zip(start, rs.pull(["small", "big"], 0)):
        assert a.tobytes() == b.tobytes()
    ref = [a.copy() for a in start]
    for step, grads in enumerate(steps):
        got = py.push_pull(step, grads)
        raw = _native.rust_push_pull(rs._w, step, [(n, g.tobytes()) for n, g in grads.items()])
        for i, name in enumerate(["small", "big"]):
            # SGD with one worker: w -= lr * g, in float32 on the PS as in NumPy.
            ref[i] = ref[i] - np.float32(lr) * grads[name]
            assert got[i].dtype == np.float32 and got[i].shape == ref[i].shape
            assert got[i].tobytes() == raw[i], f"{name} step {step}: NumPy path != Rust path"
            assert got[i].tobytes() == ref[i].tobytes(), f"{name} step {step}: != NumPy SGD"


def test_pull_fills_the_callers_arrays(launch):
    w = ibex.Worker.connect(cluster=launch(2), index=0)
    w.create_variables(variables(ibex.SGD(0.5)))
    out = [np.zeros(SMALL, np.float32), np.zeros(BIG, np.float32)]
    ids = [id(a) for a in out]
    assert w.pull(["small", "big"], 0, out=out) is None
    fresh = w.pull(["small", "big"], 0)
    assert [id(a) for a in out] == ids
    for a, b in zip(out, fresh):
        assert a.tobytes() == b.tobytes()
        assert np.abs(a).sum() > 0
    g = [np.ones(SMALL, np.float32), np.ones(BIG, np.float32)]
    assert w.push_pull(0, {"small": g[0], "big": g[1]}, out=out) is None
    np.testing.assert_array_equal(out[1], fresh[1] - np.float32(0.5))
    with pytest.raises(ValueError, match="output arrays"):
        w.pull(["small", "big"], 1, out=out[:1])
    with pytest.raises(TypeError, match="float32"):
        w.pull(["small"], 1, out=[np.zeros(SMALL)])
    with pytest.raises(ibex.ShapeMismatchError):
        w.pull(["small"], 1, out=[np.zeros((5, 3), np.float32)])


def pool_exposures(w):
    return sum(s["exposed_from_pool"] for s in w.connection_stats().values())


def remote_reads(w):
    return sum(s["remote_read_bytes"] for s in w.connection_stats().values())


def test_zero_copy_paths_seen_in_the_connection_counters(launch):
    # 256 x 1024 float32 = exactly 1 MiB: one part, on one PS.
    shape = (256, 1024)
    w = ibex.Worker.connect(cluster=launch(2), index=0)
    w.create_variables([ibex.Variable("v", shape, "zeros", ibex.SGD(1.0))])
    assert w.staging_info("v") is None  # no buffer before the first stage
    addresses = set()
    for step in range(3):
        before = (pool_exposures(w), remote_reads(w))
        staged = w.stage(["v"])
        view = staged.array("v")
        assert view.shape == shape and view.dtype == np.float32 and view.flags.writeable
        addresses.add(view.__array_interface__["data"][0])
        view[...] = 1.0
        fresh = w.push_pull_staged(step, staged)[0]
        # The PS read the gradient from the registered pool (no copy on the worker), and
        # the fresh values were read one-sided straight into the returned array's memory.
        assert pool_exposures(w) == before[0] + 1
        assert remote_reads(w) == before[1] + shape[0] * shape[1] * 4
        np.testing.assert_array_equal(fresh, np.full(shape, -(step + 1.0), np.float32))
        # Once pushed, the view can no longer be written (the PS may be reading it).
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 2.0
        with pytest.raises(ibex.IbexError, match="already pushed"):
            staged.array("v")
    # The same registered buffer every step.
    assert len(addresses) == 1
    [(ps, nbytes, fallback)] = w.staging_info("v")
    assert nbytes == shape[0] * shape[1] * 4 and fallback is None
    # A plain push reads the caller's array in place and copies it once, into that same
    # registered buffer, which the PS reads from the pool.
    before = pool_exposures(w)
    w.push(3, {"v": np.ones(shape, np.float32)})
    assert pool_exposures(w) == before + 1


def test_staged_parts_of_a_split_variable(launch):
    w = ibex.Worker.connect(cluster=launch(2), index=0)
    w.create_variables([ibex.Variable("big", BIG, "zeros", ibex.SGD(1.0))])
    staged = w.stage(["big"])
    with pytest.raises(ibex.IbexError, match="parts"):
        staged.array("big")
    parts = staged.parts("big")
    assert [off for off, _ in parts] == [0, 200, 400]
    for off, view in parts:
        view[...] = np.arange(off, off + view.shape[0], dtype=np.float32)[:, None]
    fresh = w.push_pull_staged(0, staged)[0]
    np.testing.assert_array_equal(fresh, -np.arange(600, dtype=np.float32)[:, None] * np.ones(BIG, np.float32))
    # write() scatters a whole array over the parts.
    staged = w.stage(["big"])
    staged.write("big", np.ones(BIG, np.float32))
    staged.release()
    assert staged.consumed
    busy = w.stage(["big"])
    with pytest.raises(ibex.BufferBusyError):
        w.try_stage(["big"])
    # A second lease in the same thread would wait for ever: it gives up with a message.
    with pytest.raises(ibex.BufferBusyError, match="release"):
        w.stage(["big"], timeout=0.2)
    busy.release()
    # A lease dropped with its views, neither pushed nor released, frees its buffers.
    abandoned = w.stage(["big"])
    views = [v for _, v in abandoned.parts("big")]
    del abandoned, views
    w.stage(["big"], timeout=1.0).release()


def test_per_layer_pushes_match_push_pull(launch):
    rng = np.random.default_rng(1)
    py = ibex.Worker.connect(cluster=launch(2), index=0)
    ref = ibex.Worker.connect(cluster=launch(2), index=0)
    for w in (py, ref):
        w.create_variables(variables(ibex.Momentum(0.1, 0.9)))
    for step in range(3):
        gs, gb = awkward(rng, SMALL), awkward(rng, BIG)
        s = py.begin_step(step)
        assert s.step == step
        pushed = sum(x["bytes_pushed"] for x in py.stats())
        s.push({"big": gb})  # returns at once; the caller may reuse gb
        # The layer travels in the background: the PS receives it while this thread goes
        # on (the backward pass of the next layer would run here), before any finish.
        deadline = time.monotonic() + 10
        while sum(x["bytes_pushed"] for x in py.stats()) < pushed + gb.nbytes:
            assert time.monotonic() < deadline, "the pushed layer never reached the PS"
            time.sleep(0.001)
        s.push({"small": gs})
        got = s.finish_pull(["small", "big"])
        want = ref.push_pull(step, {"small": gs, "big": gb})
        for a, b in zip(got, want):
            assert a.tobytes() == b.tobytes()
        with pytest.raises(ibex.IbexError, match="already finished"):
            s.push({"small": gs})
    s = py.begin_step(3)
    with pytest.raises(ibex.ShapeMismatchError):
        s.push({"small": np.ones(7, np.float32)})
    with pytest.raises(ibex.UnknownVariableError):
        s.push({"nope": np.ones(7, np.float32)})


def test_sparse_tables(launch):
    w = ibex.Worker.connect(cluster=launch(2), index=0)
    w.create_variables([ibex.Variable("emb", (100, 8), ("constant", 1.0), ibex.SGD(0.5), sparse=True)])
    rows = w.lookup_rows("emb", [3, 97, 3])
    assert rows.shape == (3, 8) and (rows == 1.0).all()
    w.push_sparse(0, "emb", np.array([3, 50]), np.full((2, 8), 2.0, np.float32))
    rows = w.lookup_rows("emb", np.array([3, 50, 51], dtype=np.uint64))
    np.testing.assert_array_equal(rows[:, 0], [0.0, 0.0, 1.0])
    with pytest.raises(ibex.RejectedError, match="out of range"):
        w.lookup_rows("emb", [100])
    with pytest.raises(ValueError, match="non-negative"):
        w.lookup_rows("emb", [-1])
    with pytest.raises(ibex.ShapeMismatchError):
        w.push_sparse(1, "emb", [1], np.ones((2, 8), np.float32))


def test_save_restore_and_stats(launch):
    c = launch(2)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables(variables(ibex.SGD(0.1)))
    g = {"small": np.ones(SMALL, np.float32), "big": np.ones(BIG, np.float32)}
    for step in range(2):
        w.push(step, g)
    assert w.save() == [2, 2]
    saved = w.pull(["small", "big"], 2)
    w.push(2, g)
    assert w.current_step() == 3
    assert w.restore() == 2
    assert w.current_step() == 2
    for a, b in zip(w.pull(["small", "big"], 2), saved):
        assert a.tobytes() == b.tobytes()
    stats = w.stats()
    assert [s["shard"] for s in stats] == [0, 1]
    assert all(s["step"] == 2 and s["mode"] == "sync" for s in stats)
    assert sorted(n for s in stats for n, _ in s["variables"]) == [
        "big/part_0", "big/part_1", "big/part_2", "small"]
    assert "RPCs:" in w.comm_profile()


def test_bad_input_raises_clear_exceptions(launch):
    w = ibex.Worker.connect(cluster=launch(1), index=0)
    w.create_variables([ibex.Variable("v", (4, 3), "zeros", ibex.SGD(0.1))])
    with pytest.raises(TypeError, match="float32.*float64.*astype"):
        w.push(0, {"v": np.ones((4, 3))})
    with pytest.raises(TypeError, match="numpy.ndarray"):
        w.push(0, {"v": [[1.0] * 3] * 4})
    with pytest.raises(ValueError, match="C-contiguous"):
        w.push(0, {"v": np.ones((4, 6), np.float32)[:, ::2]})
    with pytest.raises(ValueError, match="C-contiguous"):
        w.push(0, {"v": np.ones((3, 4), np.float32).T})
    with pytest.raises(ibex.ShapeMismatchError, match=r"shape \[4, 3\].*shape \[3, 4\]"):
        w.push(0, {"v": np.ones((3, 4), np.float32)})
    with pytest.raises(ibex.ShapeMismatchError):
        w.push(0, {"v": np.ones(11, np.float32)})
    with pytest.raises(ibex.UnknownVariableError, match="create_variables"):
        w.push(0, {"nope": np.ones(3, np.float32)})
    with pytest.raises(ibex.UnknownVariableError):
        w.pull(["nope"], 0)
    with pytest.raises(ValueError, match="optimizer"):
        w.create_variables([ibex.Variable("x", (2,), "zeros", _BadOpt())])
    with pytest.raises(ibex.IbexError, match="different spec"):
        w.create_variables([ibex.Variable("v", (4, 4), "zeros", ibex.SGD(0.1))])
    flat = np.ones(12, np.float32)  # a flat array of the right size is accepted
    w.push(0, {"v": flat})
    with pytest.raises(ibex.StaleStepError, match="stale step"):
        w.push(0, {"v": flat})
    assert isinstance(ibex.StaleStepError("x"), ibex.IbexError)


class _BadOpt:
    def _native(self):
        return ("rmsprop", 0.1, 0.0, 0.0, 0.0)


def test_sync_timeout_is_an_exception_naming_the_missing_worker(launch):
    c = launch(1, num_workers=2, sync_timeout_secs=1)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables([ibex.Variable("v", (4,), "zeros", ibex.SGD(0.1))])
    w.push(0, {"v": np.ones(4, np.float32)})
    t = time.monotonic()
    with pytest.raises(ibex.PsTimeoutError, match=r"workers \[1\]"):
        w.pull(["v"], 1)
    assert time.monotonic() - t < 10


def test_dead_ps_is_unavailable_not_a_hang(launch):
    c = launch(2)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables(variables(ibex.SGD(0.1)))
    c.kill_ps(1)
    t = time.monotonic()
    with pytest.raises(ibex.UnavailableError):
        w.pull(["small", "big"], 0)
    assert time.monotonic() - t < 10


def test_cluster_specs_toml_text_file_and_tf_config(launch, tmp_path, monkeypatch):
    c = launch(1)
    text = open(c.spec_path).read()
    for source in (text, c.spec_path, c.spec):
        w = ibex.Worker.connect(cluster=source, index=0)
        assert w.num_ps == 1
    tf = {"cluster": {"ps": c.spec.ps, "worker": c.spec.workers},
          "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf))
    monkeypatch.setenv("IBEX_TRANSPORT", "shm")
    w = ibex.Worker.connect()
    assert w.index == 0 and w.spec.transport == "shm"
    tf["task"]["type"] = "ps"
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf))
    with pytest.raises(ibex.SpecError, match="not a worker"):
        ibex.Worker.connect()
    with pytest.raises(ibex.SpecError, match="cannot read"):
        ibex.Worker.connect(cluster=str(tmp_path / "missing.toml"), index=0)
    with pytest.raises(ibex.SpecError, match="not valid TOML"):
        ibex.Worker.connect(cluster="[cluster]\nps = 3\n", index=0)
    with pytest.raises(ibex.SpecError, match="out of range"):
        ibex.Worker.connect(cluster=c, index=5)
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(ibex.SpecError, match="TF_CONFIG"):
        ibex.Worker.connect()


def test_python_m_ibex_ps_reports_bad_flags():
    r = subprocess.run([sys.executable, "-m", "ibex.ps", "--shard", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--listen" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ibex.ps", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert "--num-workers" in r.stdout + r.stderr
    # The wheel installs the same shard as the `ibex-ps` command beside the interpreter.
    script = os.path.join(os.path.dirname(sys.executable), "ibex-ps")
    r = subprocess.run([script, "--listen", "shm:///tmp/x.sock", "--mode", "lockstep"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "lockstep" in r.stderr


def test_asyncio_variants_run_concurrently(launch):
    import asyncio

    c = launch(1)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables([ibex.Variable("v", (4,), "zeros", ibex.SGD(1.0))])

    async def job():
        # The pull of step 1 waits at the PS until the push of step 0 lands; both are
        # awaited together, so the loop must not block on the first.
        pulled, _ = await asyncio.gather(w.apull(["v"], 1), w.apush(0, {"v": np.ones(4, np.float32)}))
        fresh = await w.apush_pull(1, {"v": np.ones(4, np.float32)})
        return pulled[0], fresh[0]

    pulled, fresh = asyncio.run(job())
    np.testing.assert_array_equal(pulled, -np.ones(4, np.float32))
    np.testing.assert_array_equal(fresh, -2 * np.ones(4, np.float32))


def test_the_gil_is_released_while_waiting(launch):
    c = launch(1)
    w = ibex.Worker.connect(cluster=c, index=0)
    w.create_variables([ibex.Variable("v", (4,), "zeros", ibex.SGD(1.0))])
    got = []
    # This pull waits at the PS until step 0 is applied: if it held the GIL, this thread
    # could neither count nor push step 0, and the test would hang.
    t = threading.Thread(target=lambda: got.append(w.pull(["v"], 1)[0]))
    t.start()
    counted = 0
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        counted += 1
    assert not got
    w.push(0, {"v": np.ones(4, np.float32)})
    t.join(timeout=10)
    assert not t.is_alive() and counted > 1000
    np.testing.assert_array_equal(got[0], -np.ones(4, np.float32))
