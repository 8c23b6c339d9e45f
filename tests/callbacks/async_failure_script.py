"""A background backup write fails (the file size limit: like a full disk).

`BackupAndRestore(save_freq=2)` saves asynchronously at steps 2 and 4; after
step 4's backup is committed, the process may write no file larger than
1 KiB (`RLIMIT_FSIZE`, SIGXFSZ ignored: writes fail with EFBIG), so step 6's
backup fails on Orbax's writer threads. Prints how `fit` ended, then lifts
the limit and restores the newest backup into a fresh model.
"""

import os
import resource
import signal
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist._checkpoint.pipeline import OrbaxSaves  # noqa: E402

backup_dir = sys.argv[1]
strategy = kd.MirroredStrategy()


def make():
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(64), keras.layers.Dense(4)]
        )
        model.compile(optimizer="adam", loss="mse")
    return model


class LimitFiles(keras.callbacks.Callback):
    """After step 4's backup is on disk, no file may grow past 1 KiB."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self.at_four = None

    def on_train_batch_begin(self, batch, logs=None):
        # Step 5 begins: BackupAndRestore (first in the list) has handled
        # step 4's end, where it saves.
        if batch == 4:
            self.backup._store.wait()
            self.at_four = [np.asarray(w) for w in self.model.get_weights()]
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))


rng = np.random.RandomState(0)
x, y = rng.randn(80, 64).astype("float32"), rng.randn(80, 4).astype("float32")
model = make()
backup = kd.callbacks.BackupAndRestore(backup_dir, save_freq=2)
limit = LimitFiles(backup)
try:
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[backup, limit], verbose=0)
    print("fit ended without an error")
except kd.errors.CheckpointWriteError as error:
    print(f"raised CheckpointWriteError: {error}")
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
fresh = make()
fresh.optimizer.build(fresh.trainable_variables)
store = OrbaxSaves(
    backup_dir, owner="BackupAndRestore", what="backup", async_save=False
)
meta = store.store.restore(fresh)
store.close()
step = int(np.asarray(fresh.optimizer.iterations.value))
same = all(
    np.array_equal(a, b)
    for a, b in zip(fresh.get_weights(), limit.at_four, strict=True)
)
print(f"restored step {step}: weights equal the model's at step 4: {same}")
