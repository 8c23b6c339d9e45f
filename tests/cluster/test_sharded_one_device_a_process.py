"""Split state over 2 real processes of one device each vs one device.

FSDP, ZeRO-1 and ParameterServer (`FixedShardsPartitioner(2)`) with one
device a process, as most GPU clusters run: each variable split over the 2
processes, one part each; fit, evaluate, predict, `ModelCheckpoint` files,
sharded checkpoints and backups as in the 2 x 4 run
(`test_sharded_multi_process.py`, which also runs the model axis and a
keras-hub transformer).
"""

import json

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close, build_in_scope, initial_weights
from tests.cluster import _workload
from tests.cluster.test_multi_worker import launch
from tests.cluster.test_sharded_multi_process import (
    HERE,
    NAMES,
    _one_process_backup,
    _onto,
    _split,
    reference,
)
from tests.cluster.test_sharded_multi_process import (
    test_fit_evaluate_predict_match_one_device as _fit_matches,
)

pytestmark = [pytest.mark.slow, pytest.mark.processes]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sharded_2x1")
    one_process_state = _one_process_backup(workdir / "one_process_backup")
    result = launch(
        HERE / "sharded_script.py", workdir, "one_device", devices=1, timeout=500
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = [json.loads((workdir / f"result_{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        result["one_process_state"] = one_process_state
    return workdir, results


@pytest.mark.parametrize("name", NAMES)
def test_each_process_holds_its_half(cluster, name):
    _, results = cluster
    for result in results:
        got = result[name]
        assert (got["replicas"], got["num_processes"]) == (2, 2)
        split = 0
        for path, (shape, held) in got["parts"].items():
            is_slot = "_momentum" in path or "_velocity" in path
            expected = shape if name == "zero1" and not is_slot else _split(shape, 2)
            assert held == [expected], path
            split += expected != shape
        assert split == (10 if name == "zero1" else 17)


@pytest.mark.parametrize("name", NAMES)
def test_fit_evaluate_predict_match_one_device(cluster, name):
    _fit_matches(cluster, name)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_load_and_restore_in_one_process(cluster, name):
    workdir, results = cluster
    files = sorted(p.name for p in (workdir / name).glob("ckpt_*"))
    assert files == ["ckpt_1.weights.h5", "ckpt_2.weights.h5"]
    model = _workload.make_model(batch_norm=True)
    model.load_weights(workdir / name / "ckpt_2.weights.h5")
    assert_weights_close(results[0][name]["fit"]["weights"], model.get_weights())
    assert isinstance(model, keras.Model)
    # The sharded checkpoint, written by both processes, exact on one.
    model = build_in_scope(_onto(1), initial_weights(batch_norm=True), batch_norm=True)
    kd.callbacks.load_checkpoint(model, workdir / name / "sharded")
    assert_weights_close(
        results[0][name]["fit"]["weights"], model.get_weights(), rtol=0, atol=0
    )


def test_a_one_process_backup_restores_onto_one_device_a_process(cluster):
    _, results = cluster
    for result in results:
        got = result["fsdp"]["from_one_process"]
        assert got["epoch"] == 1
        for expected, value in zip(
            result["one_process_state"], got["state"], strict=True
        ):
            np.testing.assert_array_equal(np.asarray(value), np.asarray(expected))
        assert got["parts_held"] == 1


def test_custom_loop_matches_one_device(cluster):
    _, results = cluster
    _, expected = reference()
    for result in results:
        got = result["fsdp"]["loop"]
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        assert_weights_close(expected["weights"], got["weights"])
