"""The demo, the benchmark and the tutorial port run as promised.

(Split from test_docs.py so the two pytest workers share the long runs; the
notebooks run in tests/test_notebooks.py.)
"""

import json
import math
import re

import pytest

from tests._docs import ROOT, as_installed, assert_quiet, run, run_with_stderr


@pytest.mark.examples
@pytest.mark.slow
def test_demo_runs_and_matches_one_device(tmp_path):
    out, err = run_with_stderr(
        [
            "examples/digits_cnn.py",
            "--epochs",
            "3",
            "--preempt-at-step",
            "14",
            "--workdir",
            str(tmp_path),
        ],
        as_installed(ROOT / "README.md"),  # README's demo install: ".[demo]".
    )
    assert_quiet(err)  # Orbax's backups and checkpoints say nothing.
    assert (
        "MirroredStrategy(devices=[cpu:0, cpu:1, ..., cpu:7], num_replicas_in_sync=8)"
        in out
    )
    assert (
        "1437 images (1293 for training), global batch 128 = 16 per replica x 8" in out
    )
    assert "last batch of each epoch: 13 images" in out
    # 11 steps per epoch; SIGTERM after step 14 (epoch 2, step 3), noticed
    # where BackupAndRestore handles that step's end (step 15's begin): saved
    # there, before step 15 runs.
    assert "preempted (SIGTERM); saved at epoch 2, step 3" in out
    assert "resuming at epoch 2, step 3" in out
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


def test_the_gpu_preset_measures_figures_to_quote(monkeypatch):
    """`--preset gpu` (gpu_preset.sh's run): 3 runs of 64-step epochs and
    every configuration the benchmarks page compares; one run of the CNN's
    6-step quick epochs is marked indicative, with both reasons."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import single_vs_mirrored as svm

    args = svm._parser().parse_args(["--preset", "gpu"])
    svm._settings(args)
    assert (args.platform, args.repeats, args.steps_of) == (
        "gpu",
        3,
        {"tiny": 64, "cnn": 64},
    )
    assert {"A", "B", "B32", "C", "E"} <= set(args.config_list)
    assert svm._indicative(args) is None
    args = svm._parser().parse_args(["--platform", "gpu", "--quick", "--repeats", "1"])
    svm._settings(args)
    assert svm._indicative(args) == (
        "1 runs per configuration (< 3); steps per epoch on gpu cnn 6 (< 50)"
    )


@pytest.mark.slow
@pytest.mark.benchmarks
def test_benchmark_quick_mode_writes_its_tables(tmp_path):
    """Smoke test of every configuration (2 steps, 1 run each): the schema.
    Each of the 2 job slots runs its configurations in one process (D, Keras
    on TensorFlow, in its own), whose rows equal fresh processes' (the
    losses below; tests/test_examples.py's shared-process test)."""
    args = ["--quick", "--steps", "2", "--epochs", "1", "--repeats", "1"]
    args += ["--models", "tiny", "--scaling", "1,8", "--jobs", "2"]
    args += ["--shared-process"]
    out = run(["benchmarks/single_vs_mirrored.py", *args, "--out", str(tmp_path)])
    why = "configurations sharing a process (--shared-process); 1 runs per "
    why += "configuration (< 3)"
    assert f"{why}: indicative only, not figures" in out
    payload = json.loads((tmp_path / "single_vs_mirrored.json").read_text())
    assert payload["indicative"] == why
    rows = {row["config"]: row for row in payload["rows"]}
    # The limits of 32 steps a dispatch need steps in multiples of 32: left
    # out of a 2-step run.
    assert list(rows) == [
        *("A", "B", "B32", "BU", "B32U", "BH", "BH32", "BN", "BN32", "BS", "BR"),
        *("C", "CS", "C0", "D", "E", "EK", "EKU", "EKH", "F"),
    ]
    for row in rows.values():
        assert "error" not in row, row
        assert row["model"] == "tiny" and row["steps"] == 2
        # One sample per fresh process, each the median of its timed epochs.
        assert len(row["ms_per_step"]) == 1 and len(row["runs"]) == 1
        assert row["crashed_runs"] in (0, 1)
        assert row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert row["examples_per_s"] > 0 and row["peak_rss_mb"] > 0
        # The main thread's CPU per step, of the same one timed epoch: some,
        # and no more than the epoch's wall time.
        assert 0 < row["host_cpu_ms"] <= row["ms_median"] * 1.01 + 0.01
    # The Keras configurations train the same model from the same initial
    # weights with the same Adam: the same loss (C0 too: it is slow, not wrong).
    losses = [rows[c]["final_loss"] for c in ("A", "B", "B32", "C", "C0", "D")]
    losses += [rows[c]["final_loss"] for c in ("BU", "B32U", "BH", "BH32")]
    assert max(losses) - min(losses) < 1e-3 * max(losses)
    assert rows["BS"]["final_loss"] != rows["B"]["final_loss"]  # Shuffled.
    # Keras's shuffle draws from NumPy's global state: the same in both.
    assert rows["CS"]["final_loss"] == pytest.approx(rows["BS"]["final_loss"])
    # The same shuffle, from the split rows: the same numbers as the copy.
    assert rows["BR"]["final_loss"] == rows["BS"]["final_loss"]
    # EK is E with Keras's Adam: the same model and data, another optimizer
    # (epsilon 1e-7 against optax's 1e-8): close, not equal.
    e, ek = rows["E"]["final_loss"], rows["EK"]["final_loss"]
    assert e != ek and abs(e - ek) < 1e-3 * e
    assert rows["EKU"]["final_loss"] == ek  # Unpaced: the same programs.
    assert rows["EKH"]["final_loss"] == ek  # The same batches, from the host.
    assert math.isnan(rows["BN"]["final_loss"])  # A step doing no work: no loss.
    assert set(rows["B"]["scaling_report"]) == {
        "compile_seconds",
        "input_ms_per_step",
        "input_fraction",
    }
    analysis = payload["analysis"]
    ratios = ["B/A", "B/C", "BS/CS", "B/C0", "B/D", "B/E", "B32/E", "B32/E32", "BS/B"]
    ratios += ["BR/BS", "F/E", "B/EK", "B32/EK32", "EK/E"]
    ratios += ["B/EKU", "B32/EK32U", "B/BU", "EK/EKU", "BH/EKH", "BH32/EKH32"]
    assert list(analysis["ratios"]["tiny"]) == ratios
    assert sorted(int(n) for n in analysis["scaling"]) == [1, 8]
    names = [t["target"] for t in analysis["targets"]]
    # The targets of 32 steps a dispatch need those limits' rows: left out.
    limits = ["B/E <= 1)", "B/C <= 1)", "BS/CS <= 1)"]
    limits += ["B/EK+BN <= 1.2)", "BH/EKH+BN <= 1.2)"]
    assert [n.split(" (")[-1] for n in names] == limits
    assert analysis["ratios"]["tiny"]["B32/E32"] is None  # No E32 row.
    assert analysis["ratios"]["tiny"]["B32/EK32"] is None
    assert analysis["ratios"]["tiny"]["B/EK"] == pytest.approx(
        rows["B"]["ms_median"] / rows["EK"]["ms_median"]
    )
    for t in analysis["targets"]:
        verdict = "PASS" if t["pass"] else "MISS"
        if t["value"] is None:
            assert f"MISS  {t['target']}: n/a" in out
            continue
        assert t["pass"] == (t["value"] <= t["limit"])
        assert f"{verdict}  {t['target']}: {t['value']:.2f}" in out
    text = (tmp_path / "single_vs_mirrored.md").read_text()
    assert "C0 Keras DataParallel, fit outside the scope (pitfall" in text
    assert text.count("| tiny |") >= 9
    assert (tmp_path / "single_vs_mirrored.png").stat().st_size > 10_000


@pytest.mark.benchmarks
def test_optimizer_benchmark_writes_its_table(tmp_path):
    """The Adam benchmark: every update on each shape, a table and the JSON."""
    args = ["--devices", "1", "--shapes", "16x4,32", "--repeats", "2"]
    out = run(["benchmarks/optimizer_update.py", *args, "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "optimizer_update.json").read_text())
    rows = [(r["devices"], r["shape"], r["update"]) for r in payload["rows"]]
    updates = ["keras", "optax", "keras-form", "optax-form"]
    assert rows == [(1, s, u) for s in ("16x4", "32") for u in updates]
    for r in payload["rows"]:
        assert len(r["samples"]) == 2
        assert 0 < r["us_min"] <= r["us_median"] <= r["us_max"]
        assert isinstance(r["vector_ops"], int) and r["vector_ops"] >= 0
        assert 0 <= r["vector_kernels"] <= r["kernels"] and r["kernels"] >= 1
        assert (r["vector_kernels"] > 0) == (r["vector_ops"] > 0)
    # The kernels' IR was dumped and read: a 32-float row is vectorized.
    assert any(r["vector_ops"] > 0 for r in payload["rows"] if r["shape"] == "32")
    assert payload["xla_flags"] == ""
    assert "| vector values in its LLVM IR | kernels with any |" in out
    assert set(payload["versions"]) == {"jax", "keras", "optax"}
    assert "| 1 | 16x4 | optax |" in out and out.count("| 1.00 |") >= 2
    assert out == (tmp_path / "optimizer_update.md").read_text() + "\n"


def test_optimizer_benchmark_names_a_bad_shape(tmp_path):
    with pytest.raises(
        AssertionError,
        match=r"--shapes takes sizes like 784x10\. "
        r"Received: '7by3'",
    ):
        run(
            [
                "benchmarks/optimizer_update.py",
                "--shapes",
                "7by3",
                "--out",
                str(tmp_path),
            ]
        )


def test_optimizer_benchmark_passes_xla_flags_and_names_a_failed_measurement(
    tmp_path,
):
    """`--xla-flags` reach XLA in the measuring process; its failure is named."""
    flag = "--xla_cpu_no_such_flag=1"
    with pytest.raises(
        AssertionError,
        match=r"The 1-device measurement failed: .*"
        r"Unknown flag in XLA_FLAGS: --xla_cpu_no_such_flag=1",
    ):
        run(
            [
                "benchmarks/optimizer_update.py",
                *("--devices", "1", "--shapes", "8", "--repeats", "1"),
                f"--xla-flags={flag}",
                *("--out", str(tmp_path)),
            ]
        )
    assert not (tmp_path / "optimizer_update.json").exists()


@pytest.mark.examples
@pytest.mark.slow
def test_seed_keras_tutorial_runs_with_only_the_strategy_lines_changed(tmp_path):
    """On exactly the install the migrating guide names for it (the `tfds`
    extra: its TensorBoard callback needs TensorBoard, which TensorFlow no
    longer brings)."""
    guide = (ROOT / "docs" / "guides" / "migrating.md").read_text()
    assert '`".[tfds]"` for TFDS' in guide and "keras_tutorial.py --mock" in guide
    out = run(
        [
            "examples/keras_tutorial.py",
            "--mock",
            "--epochs",
            "5",
            "--workdir",
            str(tmp_path),
        ],
        {
            "PYTHONPATH": str(ROOT / "tests" / "as_installed"),
            "KD_AS_INSTALLED": "tfds",
            "KD_INSTALLED_ALONE": "",
        },
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


def test_benchmark_names_what_a_crashed_run_said(tmp_path, monkeypatch):
    """A worker that aborts as XLA:CPU does: its fatal line, not its C++ stack."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _report_svm import _gist
    from _runs import run_worker

    worker = tmp_path / "aborts.py"
    fatal = (
        "F1125 12:33:32.282762   31034 rendezvous.cc:161] [id=6] Termination "
        "timeout for `all reduce RendezvousKey{run_id=RunId: -2081499063, "
        "op_id=1}` of 40 seconds exceeded. Expected 8 threads to join the "
        "rendezvous, but only 7 of them arrived on time."
    )
    worker.write_text(
        "import sys\n"
        f"sys.stderr.write('I0000 starting\\n' + {fatal!r} + '\\n'"
        " + '    @     0x7f5c909c8c91  std::__invoke_impl<>()\\n')\n"
        "sys.exit(134)\n"
    )
    row = run_worker(worker, [], timeout=60, platform_name="cpu", ident={"a": 1})
    assert row == {"a": 1, "error": fatal}
    assert _gist(row["error"]) == (
        '"Termination timeout for all reduce of 40 seconds exceeded. Expected 8 '
        'threads to join the rendezvous, but only 7 of them arrived on time."'
    )
    worker.write_text("raise SystemExit('no RESULT line')\n")
    row = run_worker(worker, [], timeout=60, platform_name="cpu", ident={})
    assert row == {"error": "no RESULT line"}


def test_shared_process_runs_give_a_fresh_process_rows_and_errors(
    tmp_path, monkeypatch
):
    """`--shared-process` (the smoke runs'): a job slot's runs in one process,
    each a fresh `__main__` with its own argv, its RESULT and its errors as a
    fresh process's; a run past its timeout or one that kills its process
    is an error row, and the next run gets a new process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "benchmarks"))  # As beside it.
    import _runs

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys, time\n"
        "from _runs import print_result\n"
        "SEEN = []\n"
        "SEEN.append(sys.argv[1])\n"
        "if sys.argv[1] == 'exit':\n"
        "    sys.exit('no RESULT: a reason')\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('a crash')\n"
        "if sys.argv[1] == 'sleep':\n"
        "    time.sleep(30)\n"
        "if sys.argv[1] == 'die':\n"
        "    os.write(2, b'F1205 17:00:00.000000 1 a.cc:1] XLA aborts\\n')\n"
        "    os._exit(3)\n"
        "print('noise')\n"
        "print_result({'pid': os.getpid(), 'seen': SEEN, 'ms_per_step': [2.0, 4.0]})\n"
    )

    def row(arg, timeout=60):
        return _runs.run_worker(
            worker, [arg], timeout=timeout, platform_name="cpu", ident={"a": arg}
        )

    fresh = [row("one"), row("two")]
    assert fresh[0]["pid"] != fresh[1]["pid"]
    try:
        _runs.share_processes()
        shared = [row("one"), row("two")]
        assert shared[0]["pid"] == shared[1]["pid"]  # One process...
        for got, want in zip(shared, fresh, strict=True):  # ...fresh modules.
            assert {**got, "pid": 0} == {**want, "pid": 0}
        assert got["seen"] == ["two"] and got["ms_median"] == 3.0
        assert row("exit") == {"a": "exit", "error": "no RESULT: a reason"}
        assert row("raise") == {"a": "raise", "error": row("raise")["error"]}
        assert "ValueError: a crash" in row("raise")["error"]
        assert row("one")["pid"] == shared[0]["pid"]  # It lives on.
        assert row("sleep", timeout=2) == {"a": "sleep", "error": "timeout"}
        # Its fatal line, as a fresh process's (its C++ log).
        fatal = "F1205 17:00:00.000000 1 a.cc:1] XLA aborts"
        assert row("die") == {"a": "die", "error": fatal}
        again = row("one")
        assert again["seen"] == ["one"] and again["pid"] != shared[0]["pid"]
    finally:
        _runs.share_processes(False)
        _runs._close_hosts()
    assert row("two")["pid"] != again["pid"]  # Off: fresh processes again.


@pytest.mark.benchmarks
def test_batch_path_counts_the_files_a_fit_batch_runs_in(tmp_path):
    out = run(
        [
            "benchmarks/batch_path.py",
            "--steps",
            "8",
            "--paths",
            "numpy,tf.data",
            "--out",
            str(tmp_path),
        ]
    )
    record = json.loads((tmp_path / "batch_path.json").read_text())
    by_path = {r["path"]: r for r in record["results"]}
    assert sorted(by_path) == ["numpy", "tf.data"]
    for path, result in by_path.items():
        # Every step goes through the one step wrapper, once.
        assert result["files"]["keras_dist/training/_step.py"] == 8 * 2, path
        assert result["file_count"] == len(result["files"])
        assert result["calls_per_batch"] > 0
        # Issue 27: at most 8 files a steady-state epoch, and a batch's road
        # crosses the layers in DESIGN.md's order, never back.
        assert result["file_count"] <= 8, (path, result["files"])
        assert result["reversals"] == 0, (path, result["layer_sequence_of_one_batch"])
        assert result["producer_reversals"] == 0, path
        road = result["layer_sequence_of_one_batch"]
        assert road == ["seams", "input", "training", "strategies"], path
        assert f"{path}: {result['file_count']} keras_dist files" in out
    # The host path reads, pads and lays out each batch; the resident one not.
    assert "keras_dist/data/host/_pipeline.py" in by_path["tf.data"]["files"]
    assert "keras_dist/data/host/_pipeline.py" not in by_path["numpy"]["files"]
    # The host path's batches are produced ahead, laid out last.
    assert by_path["tf.data"]["producer_sequence_of_one_batch"] == [
        "input",
        "strategies",
    ]
    with pytest.raises(AssertionError, match="--paths must name"):
        run(["benchmarks/batch_path.py", "--paths", "parquet"])
