"""Trains with BackupAndRestore; killed or preempted at a chosen step by env vars.

Used by tests/callbacks/test_backup_and_restore.py as a real, separate process:
    python resume_script.py OUT_DIR   (env: KD_REPLICAS, KD_BACKUP, KD_KILL_AT,
                                       KD_SIGNAL=KILL|TERM, KD_SAVE_FREQ, KD_WIDTH,
                                       KD_INPUT, KD_PLAIN, KD_ASYNC, KD_MC,
                                       KD_EPOCHS, KD_STEP_SECONDS)
KD_INPUT picks the input: "numpy" (default: shuffled arrays, validation_split),
"repeat" (tf.data shuffled each pass, `.repeat()`, steps_per_epoch=5: tf's
multi-worker tutorial), "generator" (an infinite generator, steps_per_epoch=5),
"finite-spe" (a finite tf.data of 8 batches read 3 steps per epoch: Keras keeps
one iterator across epochs), "one-shot" (a finite generator read to its end).
KD_EPOCHS (4) epochs; KD_STEP_SECONDS makes each step that much longer (a
sleep after it: the numbers do not change). Writes OUT_DIR/weights.npz and
OUT_DIR/history.json when fit completes.
"""

import json
import os
import pathlib
import random
import signal
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import keras
import numpy as np

import keras_dist as kd
from tests._helpers import resume_model

out_dir = sys.argv[1]
replicas = int(os.environ.get("KD_REPLICAS", "8"))
kill_at = int(os.environ.get("KD_KILL_AT", "-1"))
save_freq = os.environ.get("KD_SAVE_FREQ", "1")
width = int(os.environ.get("KD_WIDTH", "16"))

# Seeded as `keras.utils.set_random_seed(42)` seeds Keras (the default seeds
# of its layers come from Python's `random`), without importing TensorFlow to
# seed it too: ~3 s of each of the dozens of processes the tests start (a
# tf.data input below imports it).
random.seed(42)
np.random.seed(42)
rng = np.random.RandomState(0)
x = rng.randn(61, 6).astype("float32")  # 61 rows, batch 8: 8 steps, last of 5.
y = (x @ rng.randn(6, 3)).argmax(1).astype("int32")

if os.environ.get("KD_PLAIN"):  # Plain Keras: no strategy at all.
    import contextlib

    scope = contextlib.nullcontext()
else:
    strategy = kd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    scope = strategy.scope()
with scope:
    model = resume_model(width, metrics=["accuracy"])


class Interrupt(keras.callbacks.Callback):
    """Signals this process once step `kill_at` has ended and the checkpoint
    callback before it in the list has handled that step's end: at the next
    step's `on_train_batch_begin`, or at the end of the epoch the step ended
    (where keras_dist's callbacks handle an execution's end)."""

    def on_train_begin(self, logs=None):
        self.done = int(np.asarray(self.model.optimizer.iterations.value))
        self.running = False

    def on_train_batch_begin(self, batch, logs=None):
        if self.running:
            self._ended()
        self.running = True

    def on_epoch_end(self, epoch, logs=None):
        if self.running:
            self._ended()
        self.running = False

    def _ended(self):
        self.done += 1
        if self.done == kill_at:
            sig = (
                signal.SIGKILL
                if os.environ.get("KD_SIGNAL") == "KILL"
                else signal.SIGTERM
            )
            os.kill(os.getpid(), sig)


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(float(os.environ["KD_STEP_SECONDS"]))


callbacks = [Interrupt()]
if os.environ.get("KD_STEP_SECONDS"):
    callbacks.append(Slow())
if os.environ.get("KD_BACKUP"):
    callbacks.insert(
        0,
        kd.callbacks.BackupAndRestore(
            os.environ["KD_BACKUP"],
            save_freq="epoch" if save_freq == "epoch" else int(save_freq),
            # Killed right after a save, the tests expect that save on disk:
            # synchronous unless KD_ASYNC=1 (the async kill tests).
            async_save=os.environ.get("KD_ASYNC") == "1",
        ),
    )
if os.environ.get("KD_MC"):  # Asynchronous ModelCheckpoint files every step too.
    callbacks.insert(
        0,
        kd.callbacks.ModelCheckpoint(
            os.path.join(os.environ["KD_MC"], "ckpt_{epoch}_{batch}.weights.h5"),
            save_weights_only=True,
            save_freq=1,
            max_to_keep=3,
        ),
    )
kind = os.environ.get("KD_INPUT", "numpy")


def infinite_generator():
    draw = np.random.RandomState(5)
    while True:
        rows = draw.randint(0, len(x), size=8)
        yield x[rows], y[rows]


def one_shot_generator():
    for start in range(0, len(x), 8):
        yield x[start : start + 8], y[start : start + 8]


if kind == "numpy":
    inputs = {"x": x, "y": y, "batch_size": 8, "shuffle": True}
    inputs["validation_split"] = 0.1
else:
    import tensorflow as tf

    tf.random.set_seed(42)  # As `keras.utils.set_random_seed(42)` would.
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(61, seed=3)
    inputs = {
        "repeat": {"x": shuffled.batch(8).repeat(), "steps_per_epoch": 5},
        "generator": {"x": infinite_generator(), "steps_per_epoch": 5},
        "finite-spe": {"x": shuffled.batch(8), "steps_per_epoch": 3},
        "one-shot": {"x": one_shot_generator()},
    }[kind]
epochs = int(os.environ.get("KD_EPOCHS", "4"))
history = model.fit(epochs=epochs, verbose=0, callbacks=callbacks, **inputs)
os.makedirs(out_dir, exist_ok=True)
np.savez(os.path.join(out_dir, "weights.npz"), *model.get_weights())
with open(os.path.join(out_dir, "history.json"), "w") as f:
    json.dump(history.history, f)
print("DONE", flush=True)
