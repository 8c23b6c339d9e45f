"""Split state over 2 real processes vs one device, in two layouts.

2 processes x 4 devices: FSDP and ZeRO-1 (`MultiWorkerMirroredStrategy`
options) and `ParameterServerStrategy` split variables and slots over all 8
devices, so each variable has parts on both processes: fit (NumPy; FSDP also
PyDataset and tf.data), evaluate, predict, ModelCheckpoint (every process
takes part in the gather, the chief writes), a custom loop and (FSDP) a
keras-hub GPT-2 must give the one-device numbers; so must `model_parallel=4`
on a (2, 4) mesh whose replicas (mesh rows) each stay inside one process.

2 x 1, one device a process as most GPU clusters run (`sharded_script.py
one_device`; ParameterServer with `FixedShardsPartitioner(2)`): each variable
split over the 2 processes, one part each; fit, evaluate, predict,
`ModelCheckpoint` files, sharded checkpoints, backups and the custom loop as
in the 2 x 4 run.
"""

import functools
import json
import pathlib
import shutil

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests import _models
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
)
from tests._processes import launch
from tests.cluster import _workload

HERE = pathlib.Path(__file__).parent
NAMES = ("fsdp", "parameter_server", "zero1")
FIT_NAMES = (*NAMES, "model_parallel")
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _one_process_backup(directory) -> list:
    """A 1-process FSDP backup of distinct random values in every weight and
    optimizer variable; those values."""
    from keras_dist._checkpoint.pipeline import OrbaxSaves

    model = build_in_scope(_onto(8), initial_weights(batch_norm=True), batch_norm=True)
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(3)
    for v in _state(model):
        v.assign(rng.integers(1, 100, v.shape).astype(v.dtype))
    store = OrbaxSaves(
        str(directory), owner="BackupAndRestore", what="backup", async_save=False
    )
    store.save(model, 7, meta={"epoch": 1})
    store.close()
    return [np.asarray(v.value).tolist() for v in _state(model)]


def _state(model) -> list:
    return [*model.variables, *model.optimizer.variables]


# (processes, devices a process): 2 x 4 runs the whole script.
LAYOUTS = [(2, 4), (2, 1)]


# Each layout launched once for the module, however pytest orders the tests
# that take it (the indirect parametrizations below regroup them).
_LAUNCHED: dict = {}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}x{p[1]}")
def cluster(request, tmp_path_factory):
    if request.param not in _LAUNCHED:
        _LAUNCHED[request.param] = _launch(*request.param, tmp_path_factory)
    return _LAUNCHED[request.param]


def _launch(n: int, devices: int, tmp_path_factory) -> tuple:
    workdir = tmp_path_factory.mktemp(f"sharded_{n}x{devices}")
    # The processes restore it too (1 -> 2 processes).
    one_process_state = _one_process_backup(workdir / "one_process_backup")
    mode = ["one_device"] if devices == 1 else []
    result = launch(
        HERE / "sharded_script.py", workdir, *mode, devices=devices, timeout=500
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = [json.loads((workdir / f"result_{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        result["one_process_state"] = one_process_state
    return workdir, results


only_2x4 = pytest.mark.parametrize("cluster", [LAYOUTS[0]], indirect=True, ids=["2x4"])


# Every strategy on both layouts but the model axis, which needs several
# devices a process: 2 x 4 only.
LAYOUT_NAMES = [
    pytest.param(layout, name, id=f"{layout[0]}x{layout[1]}-{name}")
    for layout in LAYOUTS
    for name in (FIT_NAMES if layout == (2, 4) else NAMES)
]
by_layout_and_name = pytest.mark.parametrize(
    "cluster, name", LAYOUT_NAMES, indirect=["cluster"]
)


def _layout(results) -> str:
    return "2x4" if results[0]["fsdp"]["replicas"] == 8 else "2x1"


@functools.cache
def reference():
    strategy = kd.OneDeviceStrategy("cpu:0")
    return _workload.fit_run(strategy), _workload.custom_loop_run(strategy)


def _split(shape, parts: int = 8):
    """The part of a variable of `shape` on each of `parts` devices."""
    divisible = [i for i, d in enumerate(shape) if d % parts == 0]
    if not divisible:
        return list(shape)
    axis = max(divisible, key=lambda i: (shape[i], -i))
    return [d // parts if i == axis else d for i, d in enumerate(shape)]


@pytest.mark.parametrize("name", NAMES)
def test_each_process_holds_its_part(cluster, name):
    """2 x 4: four eighths of each split variable, one on each device; 2 x 1:
    half of it."""
    _, results = cluster
    replicas, local = (8, 4) if _layout(results) == "2x4" else (2, 1)
    for result in results:
        got = result[name]
        assert (got["replicas"], got["num_processes"]) == (replicas, 2)
        split = 0
        for path, (shape, held) in got["parts"].items():
            is_slot = "_momentum" in path or "_velocity" in path
            part = _split(shape, replicas)
            expected = shape if name == "zero1" and not is_slot else part
            assert held == [expected] * local, path
            split += expected != shape
        # FSDP/PS: 7 weights and 10 Adam moments split; ZeRO-1: the 10 moments.
        assert split == (10 if name == "zero1" else 17)


@only_2x4
def test_model_parallel_keeps_each_replica_inside_a_process(cluster):
    _, results = cluster
    for result in results:
        got = result["model_parallel"]
        assert got["mesh"] == {"batch": 2, "model": 4}
        assert (got["replicas"], got["num_processes"]) == (2, 2)
        split = 0
        for path, (shape, held) in got["parts"].items():
            # Automatic layouts: a kernel's wide side over the 4 devices of
            # this process (its four parts, all here), vectors whole.
            if len(shape) == 2:
                axis = max(
                    (i for i in (0, 1) if shape[i] % 4 == 0), key=shape.__getitem__
                )
                part = [d // 4 if i == axis else d for i, d in enumerate(shape)]
                split += 1
            else:
                part = shape
            assert held == [part] * 4, path
        assert split == 6  # 2 kernels and their 2 Adam moments each.


@by_layout_and_name
def test_fit_evaluate_predict_match_one_device(cluster, name):
    _, results = cluster
    expected, _ = reference()
    for result in results:
        got = result[name]["fit"]
        assert_history_close(expected["history"], got["history"])
        assert_weights_close(expected["weights"], got["weights"])
        assert got["evaluate"] == pytest.approx(expected["evaluate"], rel=1e-5)
        np.testing.assert_allclose(
            got["predict"], expected["predict"], rtol=1e-5, atol=1e-6
        )
        if name == "fsdp":  # The other input kinds: once (sharded_script.py).
            assert_history_close(expected["py_history"], got["py_history"])
            assert_weights_close(expected["py_weights"], got["py_weights"])
            assert_history_close(expected["tf_history"], got["tf_history"])
            assert_weights_close(expected["tf_weights"], got["tf_weights"])
        else:
            assert "py_history" not in got and "tf_history" not in got
    assert results[0][name]["fit"]["weights"] == results[1][name]["fit"]["weights"]


@by_layout_and_name
def test_chief_writes_loadable_checkpoints_of_split_variables(cluster, name):
    workdir, results = cluster
    files = sorted(p.name for p in (workdir / name).glob("ckpt_*"))
    assert files == ["ckpt_1.weights.h5", "ckpt_2.weights.h5"]
    model = _workload.make_model(batch_norm=True)
    model.load_weights(workdir / name / "ckpt_2.weights.h5")
    assert_weights_close(results[0][name]["fit"]["weights"], model.get_weights())
    assert isinstance(model, keras.Model)


def _onto(devices: int):
    if devices == 1:
        return kd.OneDeviceStrategy("cpu:0")
    return kd.MirroredStrategy(
        [f"cpu:{i}" for i in range(devices)], shard_variables=True
    )


@pytest.mark.parametrize("devices", [8, 1])
@by_layout_and_name
def test_two_process_sharded_checkpoints_restore_in_one_process(cluster, name, devices):
    """Written by 2 processes (each its parts, in the background): exact on 1."""
    workdir, results = cluster
    model = build_in_scope(
        _onto(devices), initial_weights(batch_norm=True), batch_norm=True
    )
    kd.callbacks.load_checkpoint(model, workdir / name / "sharded")
    assert_weights_close(
        results[0][name]["fit"]["weights"], model.get_weights(), rtol=0, atol=0
    )
    assert int(np.asarray(model.optimizer.iterations)) == 2 * 7  # 2 epochs of 7.


@only_2x4
@pytest.mark.parametrize("devices", [8, 1])
def test_two_process_async_backups_resume_in_one_process(cluster, tmp_path, devices):
    """The 2-process FSDP run's last backup: a 1-process fit resumes from it."""
    workdir, results = cluster
    backup = tmp_path / "backup"
    shutil.copytree(workdir / "fsdp" / "backup", backup)
    model = build_in_scope(
        _onto(devices), initial_weights(batch_norm=True), batch_norm=True
    )
    x, y, sw = make_data(_workload.N_TRAIN)
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=_workload.BATCH,
        epochs=_workload.EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(str(backup))],
    )
    assert history.history == {}  # Both epochs were done: nothing left to train.
    assert_weights_close(
        results[0]["fsdp"]["fit"]["weights"], model.get_weights(), rtol=0, atol=0
    )


def test_a_one_process_backup_restores_onto_two_processes(cluster):
    """A backup written by one process: each of 2 processes reads the parts
    its devices hold (FSDP over 8 devices, 4 a process; over 2, 1 a
    process), exactly."""
    _, results = cluster
    local = 4 if _layout(results) == "2x4" else 1
    for result in results:
        got = result["fsdp"]["from_one_process"]
        assert got["epoch"] == 1
        for expected, value in zip(
            result["one_process_state"], got["state"], strict=True
        ):
            np.testing.assert_array_equal(np.asarray(value), np.asarray(expected))
        assert got["parts_held"] == local


@only_2x4
@pytest.mark.parametrize("rank", [0, 1])
def test_two_process_saves_run_in_the_background(cluster, rank):
    """BackupAndRestore and sharded ModelCheckpoint save in the background
    with several processes too: each save starts on the training thread
    (Orbax's asynchronous save; its threads write and commit); JAX's
    preemption service is asked only on the training thread (a query from
    Orbax's commit thread could make the processes agree on a step the
    training thread has passed: `_private_api/_orbax_private.py`)."""
    _, results = cluster
    threads, saves = results[rank]["threads"], results[rank]["saves"]
    # 4 fits x 2 epochs of 7 steps: backups every 3 steps and at epoch ends,
    # a sharded checkpoint at each epoch end.
    assert saves["BackupAndRestore"] == 4 * 2 * 3
    assert saves["ModelCheckpoint"] == 4 * 2
    for key in ("BackupAndRestore", "ModelCheckpoint"):
        assert threads[key] == ["MainThread"], threads
    assert threads["preemption"] == ["MainThread"]
    assert saves["preemption"] >= 4 * 2 * 7


@functools.cache
def gpt2_reference():
    return _models.run_case("gpt2", kd.OneDeviceStrategy("cpu:0"))


@only_2x4
def test_keras_hub_transformer_matches_one_device(cluster):
    """GPT-2 (keras-hub) with every weight split over both processes (FSDP).

    (ZeRO-1 and ParameterServer run it on 8 devices of one process:
    tests/strategies/test_sharded_models.py; here, the MLP workload.)
    """
    _, results = cluster
    model, history, evaluated, predicted = gpt2_reference()
    atol = _models.MODELS["gpt2"].atol
    for result in results:
        got = result["fsdp"]["gpt2"]
        assert_history_close(history, got["history"], atol=atol)
        np.testing.assert_allclose(got["evaluate"], evaluated, rtol=1e-5, atol=atol)
        np.testing.assert_allclose(got["predict"], predicted, rtol=1e-5, atol=atol)
        assert_weights_close(model.get_weights(), got["weights"], atol=atol)


def test_custom_loop_with_split_weights_matches_one_device(cluster):
    _, results = cluster
    _, expected = reference()
    for result in results:
        got = result["fsdp"]["loop"]
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        assert got["correct"] == expected["correct"]
        assert_weights_close(expected["weights"], got["weights"])
