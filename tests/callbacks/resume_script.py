"""Trains with BackupAndRestore; killed or preempted at a chosen step by env vars.

Used by tests/callbacks/test_backup_and_restore.py as a real, separate process:
    python resume_script.py OUT_DIR   (env: KD_REPLICAS, KD_BACKUP, KD_KILL_AT,
                                       KD_SIGNAL=KILL|TERM, KD_SAVE_FREQ, KD_WIDTH)
Writes OUT_DIR/weights.npz and OUT_DIR/history.json when fit completes.
"""

import json
import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"

import keras
import numpy as np

import keras_dist as kd

out_dir = sys.argv[1]
replicas = int(os.environ.get("KD_REPLICAS", "8"))
kill_at = int(os.environ.get("KD_KILL_AT", "-1"))
save_freq = os.environ.get("KD_SAVE_FREQ", "1")
width = int(os.environ.get("KD_WIDTH", "16"))

keras.utils.set_random_seed(42)
rng = np.random.RandomState(0)
x = rng.randn(61, 6).astype("float32")  # 61 rows, batch 8: 8 steps, last of 5.
y = (x @ rng.randn(6, 3)).argmax(1).astype("int32")

strategy = kd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(np.asarray(self.model.optimizer.iterations.value))
        if step == kill_at:
            sig = (
                signal.SIGKILL
                if os.environ.get("KD_SIGNAL") == "KILL"
                else signal.SIGTERM
            )
            os.kill(os.getpid(), sig)


callbacks = [Interrupt()]
if os.environ.get("KD_BACKUP"):
    callbacks.insert(
        0,
        kd.callbacks.BackupAndRestore(
            os.environ["KD_BACKUP"],
            save_freq="epoch" if save_freq == "epoch" else int(save_freq),
        ),
    )
history = model.fit(
    x,
    y,
    batch_size=8,
    epochs=4,
    shuffle=True,
    validation_split=0.1,
    verbose=0,
    callbacks=callbacks,
)
os.makedirs(out_dir, exist_ok=True)
np.savez(os.path.join(out_dir, "weights.npz"), *model.get_weights())
with open(os.path.join(out_dir, "history.json"), "w") as f:
    json.dump(history.history, f)
print("DONE", flush=True)
