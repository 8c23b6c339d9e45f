"""MultiWorkerMirroredStrategy: real processes vs one process.

Two layouts: 2 processes x 4 devices (the full script), and one device a
process as most GPU clusters run, 2 x 1 (4 x 1: test_restarts.py's
`4x1-to-2x1`, whose steps before the kill the resumed run ends exactly
from); each compared with one process of as many devices and with one
device.
"""

import functools
import json

import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
    mirrored,
)
from tests._processes import CLUSTER as HERE
from tests._processes import launch
from tests.cluster import _workload

pytestmark = [pytest.mark.slow, pytest.mark.processes]


# (processes, devices a process): 2 x 4 runs the whole script.
LAYOUTS = [(2, 4), (2, 1)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}x{p[1]}")
def cluster(request, tmp_path_factory):
    n, devices = request.param
    workdir = tmp_path_factory.mktemp(f"mwms_{n}x{devices}")
    full = ["full"] if (n, devices) == (2, 4) else []
    result = launch(HERE / "mwms_script.py", workdir, *full, n=n, devices=devices)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = [json.loads((workdir / f"result_{r}.json").read_text()) for r in range(n)]
    return workdir, results


@pytest.fixture(params=["all", 1])
def n_devices(request, cluster):
    """One process of as many devices as the cluster's, and of one device."""
    _, results = cluster
    return results[0]["replicas"] if request.param == "all" else 1


@functools.cache
def reference(n_devices: int):
    strategy = kd.OneDeviceStrategy("cpu:0") if n_devices == 1 else mirrored(n_devices)
    return _workload.fit_run(strategy), _workload.custom_loop_run(strategy)


def test_the_strategy_spans_every_process(cluster):
    _, results = cluster
    n = len(results)
    local = results[0]["replicas"] // n
    for rank, result in enumerate(results):
        assert result["local_results"] == local
        assert result["rank"] == rank
        assert result["num_processes"] == n
        assert result["is_chief"] == (rank == 0)
    assert (len(results), local) in LAYOUTS


def test_fit_evaluate_predict_match_one_process(cluster, n_devices):
    _, results = cluster
    expected, _ = reference(n_devices)
    for result in results:
        got = result["fit"]
        _assert_same_run(expected, got)
        # A PyDataset of the same global batches gives the same training.
        assert_history_close(expected["history"], got["py_history"])
        assert_weights_close(expected["weights"], got["py_weights"])
        # tf.data under AutoShardPolicy.AUTO: the same global batches.
        assert_history_close(expected["tf_history"], got["tf_history"])
        assert_weights_close(expected["tf_weights"], got["tf_weights"])
        # steps_per_execution=3, fused: the numbers of one step at a time.
        assert_history_close(expected["history"], got["fused_history"])
        assert_weights_close(expected["weights"], got["fused_weights"])
        np.testing.assert_allclose(
            got["fused_predict"], expected["predict"], rtol=1e-5, atol=1e-6
        )


def test_sparse_input_matches_one_device(cluster):
    """A scipy.sparse x: laid out replicated on the 2-process mesh, exact."""
    _, results = cluster
    expected = _workload.sparse_run(kd.OneDeviceStrategy("cpu:0"))
    for result in results:
        _assert_same_run(expected, result["sparse"])


def test_eager_predict_returns_every_row_on_every_process(cluster):
    _, results = cluster
    x, _, _ = make_data(_workload.N_EVAL)
    model = build_in_scope(kd.OneDeviceStrategy("cpu:0"), initial_weights())
    expected = model.predict(x, batch_size=_workload.BATCH, verbose=0)
    for result in results:
        np.testing.assert_allclose(
            result["eager_predict"], expected, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("cluster", [LAYOUTS[0]], indirect=True, ids=["2x4"])
def test_keras_hub_generate_gives_one_devices_tokens_on_every_process(cluster):
    """`generate` lays its prompts out itself: 1, 3 and 9 prompts on 8
    replicas over 2 processes, token for token as on one device."""
    from tests import _keras_hub_lm as lm

    _, results = cluster
    with kd.OneDeviceStrategy("cpu:0").scope():
        model = lm.gemma(lm.train_proto())
        want = {
            "tokens": {
                str(n): lm.generate_tokens(model, lm.token_prompts(n))[
                    "token_ids"
                ].tolist()
                for n in (1, 3, 9)
            },
            "top_k": lm.generate_tokens(model, lm.token_prompts(3), lm.top_k())[
                "token_ids"
            ].tolist(),
            "strings": model.generate(lm.sentences(3, seed=5), stop_token_ids=None),
            "string": model.generate(lm.sentences(1, seed=6)[0], stop_token_ids=None),
        }
    for result in results:
        assert result["generate"] == want
    assert len(want["string"].split()) > len(lm.sentences(1, seed=6)[0].split())


def _assert_same_run(expected: dict, got: dict) -> None:
    """fit history and weights, evaluate, predict of `_workload` runs agree."""
    assert_history_close(expected["history"], got["history"])
    assert_weights_close(expected["weights"], got["weights"])
    assert got["evaluate"] == pytest.approx(expected["evaluate"], rel=1e-5)
    # predict: the full result (37 rows, a partial batch) on every process.
    np.testing.assert_allclose(
        got["predict"], expected["predict"], rtol=1e-5, atol=1e-6
    )
    assert np.asarray(got["predict"]).shape == (_workload.N_EVAL, 3)


def test_custom_loop_matches_one_process(cluster, n_devices):
    _, results = cluster
    _, expected = reference(n_devices)
    for result in results:
        got = result["loop"]
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        assert got["correct"] == expected["correct"]
        assert_weights_close(expected["weights"], got["weights"])


def test_every_process_ends_with_identical_weights(cluster):
    _, (first, *others) = cluster
    for other in others:
        assert first["fit"]["weights"] == other["fit"]["weights"]
        assert first["loop"]["weights"] == other["loop"]["weights"]
        # Shuffled NumPy input: every process shuffles alike (the chief's state).
        assert first["shuffled"] == other["shuffled"]


def test_only_the_chief_writes_checkpoints_and_logs(cluster):
    workdir, _ = cluster
    _, results = cluster
    names = sorted(p.name for p in workdir.iterdir() if p.is_file())
    assert names == [
        "checkpoint",
        "ckpt_1.weights.h5",
        "ckpt_2.weights.h5",
        "log_0.csv",
        *(f"result_{rank}.json" for rank in range(len(results))),
    ]
    rows = (workdir / "log_0.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + _workload.EPOCHS


def test_fit_returns_on_every_process_when_the_chiefs_files_are_complete(cluster):
    """Every process, right after `fit` returns, finds the chief's CSV with
    every epoch's row, its last checkpoint, and Keras's own BackupAndRestore
    folder deleted: `fit` returns when every process's callbacks ended it
    (as `model.save` returns when the file is complete); Keras's callback
    object counted every epoch on each process (a follower's state is
    mirrored into it)."""
    _, results = cluster
    for result in results:
        assert result["fit"]["after_fit"] == {
            "csv_rows": 1 + _workload.EPOCHS,
            "last_checkpoint": True,
            "keras_backup_deleted": True,
            "keras_backup_epoch": _workload.EPOCHS,
        }


def test_a_torn_keras_backup_is_replaced_by_the_chief_before_anyone_reads_it(
    cluster,
):
    """Keras's own BackupAndRestore resumed from a torn `latest.weights.h5`,
    the chief a second late: Keras copies the previous backup over it on the
    chief only, then every process restores it (was: the follower, reading
    first, copied it too, and a follower that read it while the chief
    copied failed part-way through the load's collectives, the chief
    waiting in one for ever: Keras's `test_backup_corrupted` across
    processes hung 1 run in 3)."""
    _, results = cluster
    chief, follower = (r["torn_keras_backup"] for r in results[:2])
    assert follower["written"] == []
    assert "latest.weights.h5" in chief["written"]
    for result in results:  # Resumed after the 1 epoch the previous backup holds.
        assert result["torn_keras_backup"]["epochs"] == [1, 2, 3]
        assert_weights_close(result["torn_keras_backup"]["weights"], chief["weights"])


def test_keras_device_cpu_0_is_each_processs_own(cluster):
    """`keras.device("cpu:0")` opens this process's first CPU (tf.distribute's
    `/cpu:0` on each worker), not process 0's: a PyDataset making its
    batches there (as Keras's `trainer_test.py` does) trains as the same
    PyDataset's NumPy batches."""
    _, results = cluster
    for result in results:
        scoped = result["device_scope"]
        assert scoped["device_process"] == result["rank"]
        np.testing.assert_allclose(scoped["scoped"], scoped["arrays"], rtol=1e-6)


# The 2 x 4 run's script also reads sharded files and datasets from a
# function (their ids are written for 2 processes of 4 devices). The same
# tuple as LAYOUTS': the module's 2 x 4 cluster, not a second one.
only_2x4 = pytest.mark.parametrize("cluster", [LAYOUTS[0]], indirect=True, ids=["2x4"])


@only_2x4
def test_file_policy_reads_every_example_once(cluster):
    _, results = cluster
    for result in results:
        # 4 files of 13/13/13/11 ids, 2 processes, global batch 8: process 0
        # reads 26 ids (7 steps of 4), process 1 24 (6 steps): 7 steps for all.
        assert sorted(result["file"]["ids"]) == list(range(50))
        assert result["file"]["steps"] == 7


@only_2x4
def test_datasets_from_function_with_uneven_processes(cluster):
    _, results = cluster
    for result in results:
        got = result["from_function"]
        assert sorted(got["ids"]) == [*range(7), *range(100, 112)]
        # Step 1: ids 0..6 and 100..107; step 2: 108..111 (process 0 is done).
        step_1 = np.mean([*range(7), *range(100, 108)])
        np.testing.assert_allclose(got["means"], [step_1, 109.5], rtol=1e-6)
