"""The NumPy example trains to the demo's bar, the same way on every push path."""

import numpy_digits


def test_numpy_example_reaches_the_demo_accuracy_bar_on_every_path():
    results = {}
    for path in ("staged", "push_pull", "overlap"):
        r = numpy_digits.run_job(numpy_digits.parse(["--path", path]))
        assert r["test_accuracy"] >= 0.9, (path, r["test_accuracy"])
        assert len(r["losses"]) == 300
        assert r["losses"][-1] < r["losses"][0] / 4
        assert "PushPull 600" in r["comm_profile"] or path == "overlap"
        results[path] = r
    # Two workers' gradients are summed commutatively on the PS and halved exactly, so the
    # three paths train bit-identically.
    assert results["staged"]["losses"] == results["push_pull"]["losses"] == results["overlap"]["losses"]
