"""One process of a `keras-dist-run -n N` MultiWorkerMirroredStrategy run.

Writes `result_<rank>.json` into the directory given as first argument: the
fit / custom-loop numbers (compared by the test with one process's runs),
the weights after a shuffled fit, keras-hub's `generate`, and — with the
second argument `full` (the 2 x 4 run) — the example ids every process saw
under AutoShardPolicy.FILE and from `distribute_datasets_from_function`.
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keras_dist as kd

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=90)
)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests._helpers import build_in_scope, initial_weights, make_data  # noqa: E402
from tests.cluster import _workload  # noqa: E402

workdir = sys.argv[1]
full = sys.argv[2:] == ["full"]
rank = jax.process_index()
local = jax.local_device_count()


def shuffled_fit() -> list:
    x, y, _ = make_data(_workload.N_TRAIN)
    model = build_in_scope(strategy, initial_weights())
    model.fit(x, y, batch_size=_workload.BATCH, epochs=2, shuffle=True, verbose=0)
    return [np.asarray(w).tolist() for w in model.get_weights()]


def file_sharded_ids() -> list:
    """4 TFRecord files of 13, 13, 13 and 11 ids; FILE policy; global batch 8."""
    folder = os.path.join(workdir, f"records_{rank}")
    os.makedirs(folder, exist_ok=True)
    files, start = [], 0
    for index, size in enumerate([13, 13, 13, 11]):
        path = os.path.join(folder, f"part-{index}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(start, start + size):
                feature = {
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        files.append(path)
        start += size
    spec = {"id": tf.io.FixedLenFeature([1], tf.int64)}
    dataset = (
        tf.data.TFRecordDataset(files)
        .map(lambda record: tf.io.parse_single_example(record, spec)["id"])
        .batch(8)
    )
    dataset = kd.data.with_auto_shard_policy(dataset, kd.data.AutoShardPolicy.FILE)
    distributed = strategy.experimental_distribute_dataset(dataset)
    seen, steps = [], 0
    for batch in distributed:
        seen += np.asarray(strategy.gather(batch, axis=0)).ravel().tolist()
        steps += 1
    return {"ids": seen, "steps": steps}


def from_function_ids() -> dict:
    """Process 0 brings ids 0..6, process 1 ids 100..111; per-replica batch 2."""

    def dataset_fn(context):
        if context.input_pipeline_id == 0:
            ids = np.arange(7, dtype="float32")
        else:
            ids = np.arange(100, 112, dtype="float32")
        return tf.data.Dataset.from_tensor_slices(ids[:, None]).batch(2)

    distributed = strategy.distribute_datasets_from_function(dataset_fn)
    seen, means = [], []
    for batch in distributed:
        seen += np.asarray(strategy.gather(batch, axis=0)).ravel().tolist()
        mean = strategy.run(lambda b: kd.losses.compute_average_loss(b[:, 0]), (batch,))
        means.append(float(strategy.reduce("sum", mean, axis=None)))
    return {"ids": seen, "means": means}


def eager_predict() -> list:
    """predict under `run_eagerly=True` (no compiled step): 37 rows, whole."""
    x, _, _ = make_data(_workload.N_EVAL)
    model = build_in_scope(strategy, initial_weights())
    model.compile(loss="mse", run_eagerly=True)
    return model.predict(x, batch_size=_workload.BATCH, verbose=0).tolist()


def keras_hub_generate() -> dict:
    """keras-hub's `generate` inside the scope: 1, 3 and 9 token prompts (9:
    the 8 replicas + 1), greedy and seeded top-k, and 3 strings and a single
    string through the SentencePiece preprocessor."""
    from tests import _keras_hub_lm as lm

    with strategy.scope():
        model = lm.gemma(lm.train_proto())
        tokens = {
            n: lm.generate_tokens(model, lm.token_prompts(n))["token_ids"].tolist()
            for n in (1, 3, 9)
        }
        top_k = lm.generate_tokens(model, lm.token_prompts(3), lm.top_k())
        strings = model.generate(lm.sentences(3, seed=5), stop_token_ids=None)
        string = model.generate(lm.sentences(1, seed=6)[0], stop_token_ids=None)
    return {
        "tokens": tokens,
        "top_k": top_k["token_ids"].tolist(),
        "strings": strings,
        "string": string,
    }


class _Rows(keras.utils.PyDataset):
    """2 batches of 8 rows; with `on_cpu0`, made under `keras.device("cpu:0")`
    as Keras's own `trainer_test.py` makes them (this process's first CPU)."""

    def __init__(self, x, y, on_cpu0):
        super().__init__()
        self.x, self.y, self.on_cpu0 = x, y, on_cpu0

    def __len__(self):
        return 2

    def __getitem__(self, index):
        rows = slice(index * 8, (index + 1) * 8)
        if not self.on_cpu0:
            return self.x[rows], self.y[rows]
        with keras.device("cpu:0"):
            return (
                keras.ops.convert_to_tensor(self.x[rows]),
                keras.ops.convert_to_tensor(self.y[rows]),
            )


def device_scoped_fit() -> dict:
    """A PyDataset of batches placed by `keras.device("cpu:0")`, against
    the same PyDataset's NumPy batches."""
    x, y, _ = make_data(16)
    with keras.device("cpu:0"):
        probe = keras.ops.ones(2)
    losses = {}
    for on_cpu0 in (True, False):
        model = build_in_scope(strategy, initial_weights())
        history = model.fit(_Rows(x, y, on_cpu0), epochs=1, verbose=0)
        losses["scoped" if on_cpu0 else "arrays"] = history.history["loss"]
    return {"device_process": next(iter(probe.devices())).process_index, **losses}


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted after 2 epochs")


class _ChiefLate(keras.callbacks.Callback):
    """The chief reaches the backup a second after the others."""

    def on_train_begin(self, logs=None):
        if rank == 0:
            time.sleep(1.0)


def torn_keras_backup() -> dict:
    """Keras's BackupAndRestore (`double_checkpoint`) interrupted after 2
    epochs, its latest weights torn by the chief, then resumed with the
    chief a second late: the epochs run, the weights, and the files each
    process opened for writing in the backup folder while resuming (Keras
    replaces the torn file with the previous one: the chief only)."""
    x, y, _ = make_data(16)
    folder = os.path.join(workdir, "torn_keras_backup")
    model = build_in_scope(strategy, initial_weights())
    backup = keras.callbacks.BackupAndRestore(folder, double_checkpoint=True)
    try:
        model.fit(
            x, y, batch_size=8, epochs=4, callbacks=[backup, _Interrupt()], verbose=0
        )
        raise AssertionError("not interrupted")
    except RuntimeError:
        pass
    if rank == 0:
        with open(os.path.join(folder, "latest.weights.h5"), "w") as f:
            f.write("0")
    written, watching = [], [True]

    def audit(event, args):
        mode = args[1] if event == "open" and isinstance(args[1], str) else ""
        inside = watching and str(args[0]).startswith(folder)
        if inside and any(c in mode for c in "wax+"):
            written.append(os.path.relpath(args[0], folder))

    sys.addaudithook(audit)
    history = model.fit(
        x, y, batch_size=8, epochs=4, callbacks=[_ChiefLate(), backup], verbose=0
    )
    watching.clear()
    return {
        "epochs": history.epoch,
        "written": sorted(set(written)),
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
    }


def local_results() -> int:
    per_replica = strategy.run(
        lambda: kd.get_replica_context().replica_id_in_sync_group
    )
    values = strategy.experimental_local_results(per_replica)
    ids = sorted(int(v) for v in values)
    assert ids == [local * rank + i for i in range(local)], ids
    return len(values)


results = {
    "rank": rank,
    "local_results": local_results(),
    "num_processes": strategy.num_processes,
    "replicas": strategy.num_replicas_in_sync,
    "is_chief": strategy.is_chief,
    "fit": _workload.fit_run(strategy, workdir, fused=True, keras_backup=True),
    "loop": _workload.custom_loop_run(strategy),
    "sparse": _workload.sparse_run(strategy),
    "eager_predict": eager_predict(),
    "shuffled": shuffled_fit(),
    "device_scope": device_scoped_fit(),
    "torn_keras_backup": torn_keras_backup(),
}
if full:  # (2 x 1: the same layout code; keras-hub's compile is long.)
    results["generate"] = keras_hub_generate()
    results["file"] = file_sharded_ids()
    results["from_function"] = from_function_ids()
with open(os.path.join(workdir, f"result_{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"rank {rank} done", flush=True)
