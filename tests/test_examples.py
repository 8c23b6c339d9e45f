"""The demo, the benchmark and the tutorial port run as promised.

(Split from test_docs.py so the two pytest workers share the long runs; the
notebooks run in tests/test_notebooks.py.)
"""

import json
import re

import pytest

from tests.test_docs import _run


@pytest.mark.slow
def test_demo_runs_and_matches_one_device(tmp_path):
    out = _run(
        [
            "examples/digits_cnn.py",
            "--epochs",
            "3",
            "--preempt-at-step",
            "14",
            "--workdir",
            str(tmp_path),
        ]
    )
    assert (
        "MirroredStrategy(devices=[cpu:0, cpu:1, ..., cpu:7], num_replicas_in_sync=8)"
        in out
    )
    assert (
        "1437 images (1293 for training), global batch 128 = 16 per replica x 8" in out
    )
    assert "last batch of each epoch: 13 images" in out
    # 11 steps per epoch; SIGTERM after step 14, saved at the next boundary (15).
    assert "preempted (SIGTERM); saved epoch 1 step 4" in out
    assert "resuming at epoch 2, step 4" in out
    for epoch in (1, 2, 3):
        assert f"Learning rate for epoch {epoch} is 0.003" in out
        assert re.search(rf"^epoch  {epoch}  loss \d\.\d{{4}}  accuracy", out, re.M)
    assert (
        "checkpoints: ['checkpoint', 'ckpt_1.weights.h5', 'ckpt_2.weights.h5', "
        "'ckpt_3.weights.h5']" in out
    )
    match = re.search(
        r"OneDeviceStrategy: test accuracy (\d\.\d{4}) in [\d.]+ s \| "
        r"MirroredStrategy x8 \(preempted and resumed\): test accuracy (\d\.\d{4}) "
        r"in [\d.]+ s \| max \|weight difference\| ([\d.e+-]+)",
        out,
    )
    assert match, out
    assert match[1] == match[2]
    assert float(match[3]) < 1e-5


@pytest.mark.slow
def test_benchmark_quick_mode_writes_its_tables(tmp_path):
    """Smoke test of every configuration (2 steps each): the schema, not speed."""
    args = ["--quick", "--steps", "2", "--repeats", "1", "--models", "tiny"]
    args += ["--scaling", "1,8", "--jobs", "2", "--out", str(tmp_path)]
    out = _run(["benchmarks/single_vs_mirrored.py", *args])
    payload = json.loads((tmp_path / "single_vs_mirrored.json").read_text())
    rows = {row["config"]: row for row in payload["rows"]}
    assert sorted(rows) == list("ABCDEF")
    for row in rows.values():
        assert "error" not in row, row
        assert row["model"] == "tiny" and row["steps"] == 2
        assert len(row["ms_per_step"]) == 1 and row["ms_median"] > 0
        assert row["examples_per_s"] > 0 and row["peak_rss_mb"] > 0
    # A, B, C and D (TensorFlow) train the same model from the same initial
    # weights with the same Adam: the same loss.
    losses = [rows[c]["final_loss"] for c in "ABCD"]
    assert max(losses) - min(losses) < 1e-3 * max(losses)
    assert set(rows["B"]["scaling_report"]) == {
        "compile_seconds",
        "input_ms_per_step",
        "input_fraction",
    }
    analysis = payload["analysis"]
    assert set(analysis["ratios"]["tiny"]) == {"B/A", "B/C", "B/D", "B/E", "F/E"}
    assert sorted(int(n) for n in analysis["scaling"]) == [1, 8]
    assert [t["target"] for t in analysis["targets"]][-1] == "tiny B ms/step <= 1.5"
    assert all(isinstance(t["pass"], bool) for t in analysis["targets"])
    assert "| target | value | result |" in out
    assert (tmp_path / "single_vs_mirrored.md").read_text().count("| tiny |") >= 6
    assert (tmp_path / "single_vs_mirrored.png").stat().st_size > 10_000


@pytest.mark.slow
def test_seed_keras_tutorial_runs_with_only_the_strategy_lines_changed(tmp_path):
    out = _run(
        [
            "examples/keras_tutorial.py",
            "--mock",
            "--epochs",
            "5",
            "--workdir",
            str(tmp_path),
        ]
    )
    assert "Number of devices: 8" in out
    for epoch, rate in [(1, "0.001"), (3, "0.001"), (4, "1e-04"), (5, "1e-04")]:
        assert f"Learning rate for epoch {epoch} is {rate}" in out
    files = [f"ckpt_{e}.weights.h5" for e in range(1, 6)]
    assert str(sorted(["checkpoint", *files])) in out
    evals = re.findall(r"^Eval loss: ([\d.]+), Eval [Aa]ccuracy: ([\d.]+)$", out, re.M)
    assert len(evals) == 3  # Latest checkpoint; loaded without and with the scope.
    for loss, accuracy in evals[1:]:
        assert abs(float(loss) - float(evals[0][0])) < 1e-5
        assert accuracy == evals[0][1]
