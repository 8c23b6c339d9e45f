"""kd.utils.ScalingReport: what it measures during a real fit."""

import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import build_in_scope, initial_weights, make_data, mirrored


def test_report_of_a_mirrored_fit():
    x, y, _ = make_data(320)
    model = build_in_scope(mirrored(8), initial_weights())
    report = kd.utils.ScalingReport(print_summary=False)
    model.fit(x, y, batch_size=64, epochs=3, validation_split=0.2, callbacks=[report])
    r = report.result
    assert r["replicas"] == 8 and r["global_batch"] == 64
    assert r["epochs"] == 3 and r["steps"] == 3 * 4  # 256 training rows / 64.
    assert len(r["ms_per_step_epochs"]) == 2  # The epochs after the first.
    assert r["ms_per_step"] == pytest.approx(np.median(r["ms_per_step_epochs"]))
    assert r["steps_per_second"] == pytest.approx(1e3 / r["ms_per_step"])
    assert r["examples_per_second"] == pytest.approx(64 * r["steps_per_second"])
    assert r["compile_seconds"] > 0
    assert 0 < r["input_ms_per_step"] < r["ms_per_step"] * 10
    assert r["total_seconds"] >= sum(r["ms_per_step_epochs"]) / 1e3 * 4
    text = report.format()
    assert "ScalingReport" in text and "replicas 8" in text


class _SlowBatches(keras.utils.PyDataset):
    """Each batch takes 30 ms to produce: far longer than the tiny step."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(0.03)
        return self.x[i * 16 : (i + 1) * 16], self.y[i * 16 : (i + 1) * 16]


def test_an_input_bound_fit_is_called_so(capsys):
    x, y, _ = make_data(64)
    model = build_in_scope(mirrored(2), initial_weights())
    report = kd.utils.ScalingReport()
    model.fit(_SlowBatches(x, y), epochs=3, callbacks=[report], verbose=0)
    r = report.result
    assert r["input_ms_per_step"] >= 30
    assert r["input_bound"] and r["input_fraction"] > 0.5
    assert "INPUT-BOUND" in capsys.readouterr().out


def test_report_says_where_the_state_lives(capsys):
    """FSDP on 8 devices, the tests' model (kernel (6, 16), bias (16,), kernel
    (16, 3) split in 8; bias (3,) replicated) with Adam."""
    x, y, _ = make_data(64)
    strategy = kd.MirroredStrategy([f"cpu:{i}" for i in range(8)], shard_variables=True)
    model = build_in_scope(strategy, initial_weights())
    report = kd.utils.ScalingReport()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[report])
    memory = report.result["memory"]
    assert memory["weight_bytes"] == (96 + 16 + 48 + 3) * 4
    assert memory["weight_bytes_per_device"] == (12 + 2 + 6 + 3) * 4
    # Adam: iteration and learning rate (replicated scalars), 2 moments each.
    assert memory["optimizer_bytes"] == 8 + 2 * 652
    assert memory["optimizer_bytes_per_device"] == 8 + 2 * 92
    assert memory["split_variables"] == 3 + 2 * 3
    assert memory["host_bytes_per_device"] == 0
    out = capsys.readouterr().out
    assert "weights         92 B per device (of 652 B)" in out
    assert "optimizer state 192 B per device (of 1.3 KiB)" in out


def test_plain_keras_fit_has_no_input_numbers():
    x, y, _ = make_data(64)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    report = kd.utils.ScalingReport(print_summary=False)
    model.fit(x, np.eye(3)[y], batch_size=16, epochs=2, callbacks=[report], verbose=0)
    assert report.result["strategy"] is None and report.result["replicas"] == 1
    assert report.result["input_ms_per_step"] is None
    assert report.result["ms_per_step"] > 0
    assert report.result["memory"] is None


def test_bad_threshold():
    with pytest.raises(ValueError, match="Received: input_bound_fraction=0"):
        kd.utils.ScalingReport(input_bound_fraction=0)
    with pytest.raises(
        TypeError, match=r"Received: input_bound_fraction='0\.5' of type str"
    ):
        kd.utils.ScalingReport(input_bound_fraction="0.5")
    assert kd.utils.ScalingReport(input_bound_fraction=1).input_bound_fraction == 1
