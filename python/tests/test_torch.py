"""ibex.torch: run wherever torch is importable (CI runs the NumPy tests only)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ibex  # noqa: E402
import ibex.torch  # noqa: E402


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def test_a_step_applies_sgd_on_the_ps_and_pulls_it_into_the_model(launch):
    w = ibex.Worker.connect(cluster=launch(2), index=0)
    m = net()
    opt = ibex.torch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.25), m.named_parameters(), w)
    names = [n for n, _ in m.named_parameters()]
    # The PS's initial values replaced the local ones.
    for (n, p), v in zip(m.named_parameters(), w.pull(names, 0)):
        assert p.detach().numpy().tobytes() == v.tobytes()
    x, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 0, 1])
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    # The hooks pushed every layer during backward, before step().
    assert sorted(opt._pushed) == sorted(names)
    before = [(p.detach().clone(), p.grad.clone()) for p in m.parameters()]
    opt.step()
    for p, (w0, g) in zip(m.parameters(), before):
        assert p.detach().numpy().tobytes() == (w0 - np.float32(0.25) * g).numpy().tobytes()
    assert opt.step_count == 1 and w.current_step() == 1


def test_parameters_without_gradients_push_zeros(launch):
    w = ibex.Worker.connect(cluster=launch(1), index=0)
    m = net()
    opt = ibex.torch.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(), w, overlap=False)
    first = [p.detach().clone() for p in m.parameters()]
    opt.step()  # no backward at all: every variable still takes part in the sync step
    for p, f in zip(m.parameters(), first):
        assert torch.equal(p, f)
    assert w.current_step() == 1


def test_unsupported_optimizers_and_parameters_are_refused(launch):
    w = ibex.Worker.connect(cluster=launch(1), index=0)
    m = net()
    with pytest.raises(ValueError, match="nesterov"):
        ibex.torch.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), m.named_parameters(), w)
    with pytest.raises(ValueError, match="no PS equivalent"):
        ibex.torch.DistributedOptimizer(torch.optim.RMSprop(m.parameters()), m.named_parameters(), w)
    d = torch.nn.Linear(2, 2).double()
    with pytest.raises(TypeError, match="float32"):
        ibex.torch.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), d.named_parameters(), w)
    assert isinstance(ibex.torch.ps_optimizer(torch.optim.Adam(m.parameters(), lr=0.01)), ibex.Adam)


def test_torch_example_reaches_the_demo_accuracy_bar():
    import torch_digits

    # In async mode the PS applies each worker's gradient on arrival instead of averaging
    # the two: half the learning rate keeps the effective step the same.
    for extra in ([], ["--mode", "async", "--lr", "0.025"]):
        r = torch_digits.run_job(torch_digits.parse(extra))
        assert r["test_accuracy"] >= 0.9, (extra, r["test_accuracy"])


def test_auto_overlap_settles_and_trains_bit_for_bit_like_either_choice(tmp_path):
    finals = {}
    for overlap in ("auto", False, True):
        with ibex.launch_local(2, 1, directory=str(tmp_path / str(overlap)), sync_timeout_secs=10) as c:
            w = ibex.Worker.connect(cluster=c, index=0)
            m = net()
            opt = ibex.torch.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(), w,
                overlap=overlap)
            g = torch.Generator().manual_seed(3)
            for step in range(10):
                x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                if overlap == "auto" and step < 7:
                    assert opt.overlap_chosen is None, step
            assert opt.overlap_chosen in (True, False) if overlap == "auto" else opt.overlap_chosen is overlap
            assert w.current_step() == 10
            finals[overlap] = [p.detach().numpy().tobytes() for p in m.parameters()]
    assert finals["auto"] == finals[False] == finals[True]
