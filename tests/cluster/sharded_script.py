"""One process of a `keras-dist-run -n 2` run of the split-state strategies.

ParameterServerStrategy (FixedShardsPartitioner(8)) and
MultiWorkerMirroredStrategy with `shard_variables` (FSDP) and
`shard_optimizer_state` (ZeRO-1) over 2 processes x 4 devices: the split
variables have parts on both processes; and with `model_parallel=4`: a
(2, 4) mesh, the model split inside each process. Writes `result_<rank>.json`: the
`_workload` numbers and a keras-hub GPT-2's (compared with one device by the
test) and the shapes of the parts each process holds. With the second
argument `one_device` (2 processes x 1 device): the same but the model axis
and the transformer, each variable split over the 2 devices.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keras_dist as kd

# `one_device` (2 x 1): the partitioner's shards are the 2 devices, and no
# model axis (it has to stay inside a process), no transformer.
ONE_DEVICE = sys.argv[2:] == ["one_device"]
OPTIONS = kd.CommunicationOptions(timeout_seconds=90)
STRATEGIES = {
    "fsdp": lambda: kd.MultiWorkerMirroredStrategy(
        communication_options=OPTIONS, shard_variables=True
    ),
    "parameter_server": lambda: kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.FixedShardsPartitioner(
            2 if ONE_DEVICE else 8
        )
    ),
    "zero1": lambda: kd.MultiWorkerMirroredStrategy(
        communication_options=OPTIONS, shard_optimizer_state=True
    ),
    # A (2, 4) mesh: each process is one replica of 4 devices holding the
    # model between them; "batch" spans the processes.
    "model_parallel": lambda: kd.MultiWorkerMirroredStrategy(
        communication_options=OPTIONS, model_parallel=4
    ),
}
if ONE_DEVICE:
    del STRATEGIES["model_parallel"]
built = {name: make() for name, make in STRATEGIES.items()}

import jax  # noqa: E402

from tests import _models  # noqa: E402
from tests._helpers import build_in_scope, initial_weights  # noqa: E402
from tests.cluster import _workload  # noqa: E402

workdir = sys.argv[1]
rank = jax.process_index()


def record_threads() -> dict:
    """Records the thread that starts every Orbax save of keras_dist's
    callbacks (by the callback) and of every query of JAX's preemption
    service (`threads` in the result)."""
    import threading

    from jax.experimental import multihost_utils

    from keras_dist._checkpoint.pipeline import OrbaxSaves

    threads: dict = {"BackupAndRestore": [], "ModelCheckpoint": [], "preemption": []}

    def recorded(owner, name, key):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            store = args[0] if key is None else None
            threads[key or store.owner].append(threading.current_thread().name)
            return original(*args, **kwargs)

        setattr(owner, name, call)

    recorded(OrbaxSaves, "save", None)
    recorded(multihost_utils, "reached_preemption_sync_point", "preemption")
    return threads


threads = record_threads()


def gpt2_run(strategy) -> dict:
    """The keras-hub GPT-2 of the 8-device acceptance test, on 2 x 4 devices."""
    model, history, evaluated, predicted = _models.run_case("gpt2", strategy)
    return {
        "history": history,
        "weights": [w.tolist() for w in model.get_weights()],
        "evaluate": evaluated,
        "predict": predicted.tolist(),
    }


def parts(strategy) -> dict:
    """Per variable: global shape, and the shapes of this process's parts."""
    model = build_in_scope(strategy, initial_weights(batch_norm=True), batch_norm=True)
    model.optimizer.build(model.trainable_variables)
    return {
        v.path: [
            list(v.shape),
            [list(s.data.shape) for s in v.value.addressable_shards],
        ]
        for v in [*model.weights, *model.optimizer.variables]
    }


def from_one_process(strategy) -> dict:
    """The test's 1-process FSDP backup, restored here."""
    import numpy as np
    from jax.experimental import multihost_utils

    from keras_dist._checkpoint.pipeline import OrbaxSaves

    model = build_in_scope(strategy, initial_weights(batch_norm=True), batch_norm=True)
    model.optimizer.build(model.trainable_variables)
    store = OrbaxSaves(
        os.path.join(workdir, "one_process_backup"),
        owner="BackupAndRestore",
        what="backup",
        async_save=False,
    )
    meta = store.store.restore(model)
    store.close()
    state = [*model.variables, *model.optimizer.variables]
    kernel = model.trainable_variables[0].value
    return {
        "epoch": meta["epoch"],
        "state": [
            np.asarray(multihost_utils.process_allgather(v.value, tiled=True)).tolist()
            for v in state
        ],
        "parts_held": len(kernel.addressable_shards),
    }


results = {"rank": rank}
for name, strategy in built.items():
    checkpoints = os.path.join(workdir, name)
    os.makedirs(checkpoints, exist_ok=True)
    results[name] = {
        "replicas": strategy.num_replicas_in_sync,
        "mesh": dict(strategy.mesh.shape),
        "num_processes": strategy.num_processes,
        "parts": parts(strategy),
        # The input kinds (PyDataset, tf.data) once: how the state is split
        # does not change the input path (tests/cluster/mwms_script.py runs
        # them on Mirrored).
        "fit": _workload.fit_run(strategy, checkpoints, other_inputs=name == "fsdp"),
    }
# FSDP splits every weight over both processes: the transformer runs there;
# ZeRO-1 and ParameterServer run it on 8 devices of one process
# (tests/strategies/test_sharded_models.py), the MLP workload here.
results["fsdp"]["from_one_process"] = from_one_process(built["fsdp"])
if not ONE_DEVICE:
    results["fsdp"]["gpt2"] = gpt2_run(built["fsdp"])
results["fsdp"]["loop"] = _workload.custom_loop_run(built["fsdp"])
results["threads"] = {key: sorted(set(names)) for key, names in threads.items()}
results["saves"] = {key: len(names) for key, names in threads.items()}
with open(os.path.join(workdir, f"result_{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"rank {rank} done", flush=True)
