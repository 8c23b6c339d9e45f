"""One process of a 2-process run (started by hand, TF_CONFIG) that backs
up and checkpoints where the test says.

    storage_script.py WORKDIR BACKUP_DIR CHECKPOINT_DIR [LATE_S]

3 epochs of `_helpers.make_data(40)` (batch 8) under
`MultiWorkerMirroredStrategy` with `BackupAndRestore(BACKUP_DIR)` and
`ModelCheckpoint(CHECKPOINT_DIR/ckpt_{epoch}.weights.h5)`; writes
`WORKDIR/weights_<rank>.json`, then saves `final.weights.h5` and
`final.keras` to CHECKPOINT_DIR (every process calls Keras's
`save_weights`/`save`), loads them back and writes whether they equal the
model (`WORKDIR/reloaded_<rank>.json`); or on an error `WORKDIR/error_<rank>.json`
(its type, message and the seconds `fit` took to raise it) and raises it
on (keras_dist's exit hook then ends the process with status 1, process 0
after its peers). With LATE_S, process 1 records and raises its error
LATE_S seconds after process 0 (the order a loaded machine may give).
"""

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=90)
)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests._helpers import build_in_scope, initial_weights, make_data  # noqa: E402

workdir, backup_dir, checkpoint_dir = sys.argv[1:4]
late_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
rank = jax.process_index()
x, y, _ = make_data(40)
model = build_in_scope(strategy, initial_weights())
callbacks = [
    kd.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False),
    kd.callbacks.ModelCheckpoint(
        f"{checkpoint_dir}/ckpt_{{epoch}}.weights.h5", save_weights_only=True
    ),
]
started = time.monotonic()
try:
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
except Exception as error:
    record = {
        "type": type(error).__name__,
        "message": str(error),
        "seconds": time.monotonic() - started,
    }
    time.sleep(late_s * rank)
    pathlib.Path(workdir, f"error_{rank}.json").write_text(json.dumps(record))
    raise
weights = [w.tolist() for w in model.get_weights()]
pathlib.Path(workdir, f"weights_{rank}.json").write_text(json.dumps(weights))
# Keras's save and load calls, on every process, into the same folder.
model.save_weights(f"{checkpoint_dir}/final.weights.h5")
model.save(f"{checkpoint_dir}/final.keras")
reloaded = build_in_scope(strategy, initial_weights())
reloaded.load_weights(f"{checkpoint_dir}/final.weights.h5")
with strategy.scope():
    loaded = keras.saving.load_model(f"{checkpoint_dir}/final.keras")
mine = model.get_weights()
same = [
    all(np.array_equal(a, b) for a, b in zip(mine, other.get_weights(), strict=True))
    for other in (reloaded, loaded)
]
pathlib.Path(workdir, f"reloaded_{rank}.json").write_text(json.dumps(same))
