"""kd.utils.ScalingReport: what it measures during a real fit."""

import re
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.data import _call
from keras_dist.data.resident._resident import ResidentPass
from keras_dist.data.resident._resident_data import lay_out_resident
from tests._helpers import (
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    mirrored,
)

_BREAKDOWN_LINE = re.compile(
    r"breakdown +step time (\d+\.\d\d) ms = input (\d+\.\d\d|n/a) \+ "
    r"dispatch (\d+\.\d\d) \+ device (\d+\.\d\d) ms/step "
    r"\((\d+%|n/a) / \d+% / \d+%\)"
)


def _assert_breakdown_adds_up(r):
    """The parts of a step add up to its mean wall time.

    Input (the step loop's wait for a batch) and dispatch (its calls of the
    step program) are disjoint intervals of one thread inside the timed
    epochs, and device is the rest: the sum is the step time to float
    rounding (1e-9), and the two measured parts alone never exceed it.
    """
    b = r["breakdown"]
    parts = [b["input_ms"] or 0.0, b["dispatch_ms"], b["device_ms"]]
    assert all(part >= 0 for part in parts)
    assert b["dispatch_ms"] > 0
    assert sum(parts) == pytest.approx(b["step_ms"], rel=1e-9)
    assert parts[0] + parts[1] <= b["step_ms"] * (1 + 1e-9)
    shares = [b["input_share"] or 0.0, b["dispatch_share"], b["device_share"]]
    assert sum(shares) == pytest.approx(1.0, rel=1e-9)
    assert r["dispatch_ms_per_step"] == b["dispatch_ms"]
    assert r["device_ms_per_step"] == b["device_ms"]


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
    # Where the time goes: validation (64 rows, 1 step an epoch) left out.
    _assert_breakdown_adds_up(r)
    assert r["breakdown"]["input_ms"] > 0  # Device-resident: laid out per step.
    # Two timed epochs of 4 steps each: their mean is their median.
    assert r["breakdown"]["step_ms"] == pytest.approx(r["ms_per_step"], rel=1e-9)
    assert r["dispatches"] == 12 and r["steps_per_dispatch"] == 1
    text = report.format()
    assert "ScalingReport" in text and "replicas 8" in text
    line = _BREAKDOWN_LINE.search(text)
    assert line is not None, text
    b = r["breakdown"]
    expected = [b["step_ms"], b["input_ms"], b["dispatch_ms"], b["device_ms"]]
    assert [float(v) for v in line.groups()[:4]] == pytest.approx(expected, abs=0.006)
    assert "dispatches      12 (1 step each)" in text


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_steps_per_execution_counts_steps_and_dispatches(fuse_steps, capsys):
    """steps_per_execution=4: one program a group when fused, four if not."""
    x, y, _ = make_data(256)
    strategy = mirrored(8)
    strategy.input_options = kd.InputOptions(fuse_steps=fuse_steps)
    model = build_in_scope(strategy, initial_weights())
    compile_model(model, steps_per_execution=4)
    report = kd.utils.ScalingReport()
    model.fit(x, y, batch_size=16, epochs=3, callbacks=[report], verbose=0)
    r = report.result
    assert r["steps"] == 3 * 16  # Steps, not Keras's groups of 4.
    assert len(r["ms_per_step_epochs"]) == 2
    _assert_breakdown_adds_up(r)
    if fuse_steps:
        assert r["dispatches"] == r["steps"] / 4 and r["steps_per_dispatch"] == 4
        assert "dispatches      12 (4 steps each)" in capsys.readouterr().out
    else:
        assert r["dispatches"] == r["steps"] and r["steps_per_dispatch"] == 1


def test_a_fused_group_counts_its_batches():
    """A device-resident group of 4 batches, laid out at once, is 4 batches."""
    x, y, _ = make_data(64)
    strategy = mirrored(8)
    state = _call.CallState(method="fit", strategy=strategy)
    resident = lay_out_resident(strategy.placement, (x, y))
    batches = (slice(i, i + 8) for i in range(0, 64, 8))
    input_pass = ResidentPass(strategy.placement, resident, batches, call=state)
    input_pass.next_group(4)  # The pass's first: its time is kept apart.
    input_pass.next_group(4)
    stats = state.input_stats
    assert stats.batches == 4 and stats.taken == 8 and state.batch_size == 8
    assert stats.seconds > 0 and stats.first_seconds > 0 and stats.waited > 0


class _SlowBatches(keras.utils.PyDataset):
    """Each batch takes 100 ms to produce: far longer than the tiny step, even
    on a loaded machine (30 ms was not, with 3 test workers on 2 cores)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(0.1)
        return self.x[i * 16 : (i + 1) * 16], self.y[i * 16 : (i + 1) * 16]


def test_an_input_bound_fit_is_called_so(capsys):
    x, y, _ = make_data(64)
    model = build_in_scope(mirrored(2), initial_weights())
    report = kd.utils.ScalingReport()
    model.fit(_SlowBatches(x, y), epochs=3, callbacks=[report], verbose=0)
    r = report.result
    assert r["input_ms_per_step"] >= 100
    assert r["input_bound"] and r["input_fraction"] > 0.5
    # The step loop waits for each batch: 100 ms, less what one step (a few
    # ms) hides behind the prefetch thread.
    _assert_breakdown_adds_up(r)
    assert r["breakdown"]["input_ms"] >= 50 and r["breakdown"]["input_share"] > 0.5
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
    r = report.result
    assert r["strategy"] is None and r["replicas"] == 1
    assert r["input_ms_per_step"] is None
    assert r["ms_per_step"] > 0
    assert r["memory"] is None
    # Keras's own input is not timed: its wait counts in the rest (device).
    _assert_breakdown_adds_up(r)
    assert r["breakdown"]["input_ms"] is None and r["breakdown"]["input_share"] is None
    assert r["dispatches"] == r["steps"] == 2 * 4
    assert "input n/a + dispatch" in report.format()


def test_bad_threshold():
    with pytest.raises(ValueError, match="Received: input_bound_fraction=0"):
        kd.utils.ScalingReport(input_bound_fraction=0)
    with pytest.raises(
        TypeError, match=r"Received: input_bound_fraction='0\.5' of type str"
    ):
        kd.utils.ScalingReport(input_bound_fraction="0.5")
    assert kd.utils.ScalingReport(input_bound_fraction=1).input_bound_fraction == 1


def _dense_fit(strategy, report, steps_per_execution=1):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        # Enough weights that XLA's combined all-reduce is a tuple whose
        # text numbers its elements (`/*index=5*/`).
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(256),
                keras.layers.Dense(32),
                keras.layers.Dense(16),
                keras.layers.Dense(8),
            ]
        )
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x = np.ones((512, 64), "float32")
    model.fit(
        x,
        np.ones((512, 8), "float32"),
        batch_size=64,
        epochs=2,
        verbose=0,
        callbacks=[report],
    )
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_model_flops_and_collectives_come_from_the_compiled_step(steps_per_execution):
    report = kd.utils.ScalingReport(print_summary=False, peak_flops=1e12)
    params = _dense_fit(mirrored(8), report, steps_per_execution)
    r = report.result
    # A dense step: 2 FLOPs per weight and example forward, 2 for the weights'
    # gradients, 2 for the inputs' (all but the first layer's): 4 to 6.
    assert 4 * params * 64 <= r["model_flops_per_step"] <= 6 * params * 64
    # Mirrored: each device all-reduces every gradient (float32) once a step,
    # and the loss and metrics' few scalars.
    assert set(r["collective_bytes"]) == {"all-reduce"}
    assert 4 * params <= r["collective_bytes"]["all-reduce"] <= 4 * params + 64
    step = r["ms_per_step"] / 1e3
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / (step * 1e12 * 8))
    assert re.search(r"MFU +\d+\.\d% of 1 TFLOP/s per device", report.format())


def test_a_2d_mesh_sends_less_than_mirrored_and_the_same_flops():
    reports = [kd.utils.ScalingReport(print_summary=False) for _ in range(2)]
    _dense_fit(mirrored(8), reports[0])
    _dense_fit(kd.MirroredStrategy(model_parallel=4), reports[1])
    mirrored_r, two_d = (r.result for r in reports)
    assert two_d["model_flops_per_step"] == pytest.approx(
        mirrored_r["model_flops_per_step"], rel=0.25
    )
    sent = sum(two_d["collective_bytes"].values())
    assert sent < 0.5 * sum(mirrored_r["collective_bytes"].values())
    assert two_d["mfu"] is None  # CPU: no known peak, and none given.
    assert "MFU             n/a (peak FLOP/s unknown" in reports[1].format()


def test_peak_flops_by_device_kind_and_bad_values():
    from keras_dist.training._step_cost import peak_flops

    def device(kind):
        return type("D", (), {"device_kind": kind})()

    assert peak_flops(device("TPU v5 lite")) == 197e12
    assert peak_flops(device("TPU v5p")) == 459e12
    assert peak_flops(device("NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops(device("cpu")) is None
    with pytest.raises(ValueError, match=r"Received: peak_flops=0"):
        kd.utils.ScalingReport(peak_flops=0)
    with pytest.raises(ValueError, match=r"Received: peak_flops='1e12'"):
        kd.utils.ScalingReport(peak_flops="1e12")
