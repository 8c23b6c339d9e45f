"""SidecarEvaluator: each checkpoint once, numbers of model.evaluate, CSV, best."""

import csv
import json
import os
import pathlib
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_model,
    mirrored,
)
from tests._processes import process_env
from tests.callbacks._sidecar import XV, YV, X, Y, evaluator_model


def _train(directory, epochs=3, **checkpoint_kwargs) -> keras.Model:
    model = build_in_scope(mirrored(4), initial_weights())
    checkpoint = kd.callbacks.ModelCheckpoint(
        os.path.join(directory, "ckpt_{epoch}"),
        save_weights_only=True,
        **checkpoint_kwargs,
    )
    model.fit(X, Y, batch_size=8, epochs=epochs, verbose=0, callbacks=[checkpoint])
    return model


def _evaluate(path) -> dict:
    model = evaluator_model()
    model.load_weights(path)
    return model.evaluate(XV, YV, verbose=0, return_dict=True)


def test_each_checkpoint_once_with_evaluate_numbers_csv_and_best(tmp_path):
    _train(tmp_path)
    log = tmp_path / "eval.csv"
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(),
        (XV, YV),
        tmp_path,
        callbacks=[keras.callbacks.CSVLogger(str(log))],
        idle_timeout=30,
        poll_interval=0.05,
    )
    start = time.monotonic()
    evaluator.start()
    assert time.monotonic() - start < 20  # Stopped on the `done` marker.
    names = [os.path.basename(r["checkpoint"]) for r in evaluator.history]
    assert names == [f"ckpt_{e}.weights.h5" for e in (1, 2, 3)]
    assert [r["epoch"] for r in evaluator.history] == [0, 1, 2]
    for record in evaluator.history:
        expected = _evaluate(record["checkpoint"])
        for name, value in expected.items():
            np.testing.assert_allclose(record["metrics"][name], value, rtol=1e-6)
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    for row, record in zip(rows, evaluator.history, strict=True):
        np.testing.assert_allclose(float(row["loss"]), record["metrics"]["loss"])
    best = min(evaluator.history, key=lambda r: r["metrics"]["loss"])
    assert evaluator.best == best
    summary = json.loads((tmp_path / "best" / "best.json").read_text())
    assert summary["checkpoint"] == best["checkpoint"]
    assert summary["monitor"] == "loss"
    assert summary["value"] == best["metrics"]["loss"]
    kept, source = evaluator_model(), evaluator_model()
    kept.load_weights(tmp_path / "best" / "best.weights.h5")
    source.load_weights(best["checkpoint"])
    assert_weights_close(source.get_weights(), kept.get_weights(), rtol=0, atol=0)


def test_best_by_a_max_metric_and_max_evaluations(tmp_path):
    _train(tmp_path, epochs=4)
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(),
        (XV, YV),
        tmp_path,
        max_evaluations=2,
        monitor="accuracy",
        best_dir=tmp_path / "mine",
        poll_interval=0.05,
    )
    evaluator.start()
    assert len(evaluator.history) == 2
    accuracy = [r["metrics"]["accuracy"] for r in evaluator.history]
    assert evaluator.best == evaluator.history[int(np.argmax(accuracy))]
    assert evaluator.mode == "max"
    assert (tmp_path / "mine" / "best.weights.h5").exists()
    assert not (tmp_path / "best").exists()


def test_no_checkpoint_times_out_within_the_idle_timeout(tmp_path):
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(), (XV, YV), tmp_path / "none", idle_timeout=0.5
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no checkpoint appeared in .*none"):
        evaluator.start()
    assert time.monotonic() - start < 3


def test_without_an_index_it_stops_after_the_idle_timeout(tmp_path, capsys):
    # Keras's own ModelCheckpoint: no index, no `done` marker.
    model = build_in_scope(mirrored(4), initial_weights())
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "k_{epoch}.weights.h5"), save_weights_only=True
    )
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[checkpoint])
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(), (XV, YV), tmp_path, idle_timeout=0.5, best_dir=None
    )
    start = time.monotonic()
    evaluator.start()
    assert time.monotonic() - start < 5
    names = sorted(os.path.basename(r["checkpoint"]) for r in evaluator.history)
    assert names == ["k_1.weights.h5", "k_2.weights.h5"]
    assert [r["epoch"] for r in evaluator.history] == [0, 1]  # Counted.
    assert (
        "no new checkpoint for 0.5 s after 2 evaluation(s)" in capsys.readouterr().err
    )
    assert not (tmp_path / "best").exists()


def test_a_rewritten_checkpoint_is_evaluated_again(tmp_path):
    _train(tmp_path, epochs=1)
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(), (XV, YV), tmp_path, idle_timeout=0.3, poll_interval=0.05
    )
    from keras_dist.callbacks._sidecar_evaluator import CheckpointWatch

    watch = CheckpointWatch(str(tmp_path))
    assert len(watch.new_checkpoints()) == 1
    assert watch.new_checkpoints() == []
    path = tmp_path / "ckpt_1.weights.h5"
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert [c.path for c in watch.new_checkpoints()] == [str(path)]
    evaluator.start()
    assert len(evaluator.history) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"steps": 0}, ValueError, r"`steps` must be an integer >= 1 or None\. "),
        (
            {"max_evaluations": 1.5},
            ValueError,
            r"max_evaluations=1\.5 \(of type float\)",
        ),
        ({"idle_timeout": 0}, ValueError, "`idle_timeout` must be > 0 seconds"),
        ({"poll_interval": "1"}, TypeError, "poll_interval='1' of type str"),
        ({"mode": "best"}, ValueError, "mode='best'"),
    ],
)
def test_bad_arguments_fail_at_creation(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        kd.callbacks.SidecarEvaluator(evaluator_model(), (XV, YV), tmp_path, **kwargs)


def test_an_uncompiled_model_or_unknown_monitor_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must be a compiled keras\.Model"):
        kd.callbacks.SidecarEvaluator(make_model(), (XV, YV), tmp_path)
    _train(tmp_path, epochs=1)
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(), (XV, YV), tmp_path, monitor="val_acc"
    )
    with pytest.raises(ValueError, match=r"`monitor='val_acc'` is not among"):
        evaluator.start()


def test_a_tf_config_evaluator_runs_locally_instead_of_joining():
    resolver = kd.cluster.TFConfigClusterResolver(
        tf_config={
            "cluster": {
                "worker": ["127.0.0.1:1", "127.0.0.1:2"],
                "evaluator": ["127.0.0.1:3"],
            },
            "task": {"type": "evaluator", "index": 0},
        }
    )
    assert kd.cluster.initialize(resolver) == resolver
    assert not kd.cluster.is_initialized()
    strategy = kd.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    assert strategy.num_replicas_in_sync == 8  # This process's own devices.
    assert strategy.cluster_resolver.task_type == "evaluator"


def _launch_with_evaluator(workdir, env=None):
    script = pathlib.Path(__file__).with_name("sidecar_script.py")
    environ = process_env(env)
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2", "--evaluator"]
    command += ["--devices-per-process", "2", str(script), str(workdir)]
    return subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.processes
def test_keras_dist_run_evaluator_beside_two_workers(tmp_path):
    result = _launch_with_evaluator(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "[evaluator] keras_dist: this process is the evaluator" in result.stderr
    assert "[0] keras_dist: joining as process 0 of 2" in result.stderr
    history = json.loads((tmp_path / "evaluations.json").read_text())
    assert [r["epoch"] for r in history] == [0, 1, 2]
    for record in history:
        expected = _evaluate(record["checkpoint"])
        for name, value in expected.items():
            np.testing.assert_allclose(record["metrics"][name], value, rtol=1e-6)
    with open(tmp_path / "eval.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.processes
def test_a_failing_evaluator_does_not_stop_training(tmp_path):
    result = _launch_with_evaluator(tmp_path, {"KD_EVALUATOR_FAILS": "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        "keras-dist-run: the evaluator exited with status 1; training goes on."
        in result.stderr
    )
    assert "[0] rank 0 trained" in result.stdout
    assert "[1] rank 1 trained" in result.stdout
    assert (tmp_path / "ckpts" / "ckpt_3.weights.h5").exists()
