"""The training runs compared between 2 processes x 4 devices, 1 x 8 and 1 x 1.

`fit_run` and `custom_loop_run` take any strategy and return plain numbers, so
the multi-process script (`mwms_script.py`) and the in-process reference
(`test_multi_worker.py`) run exactly the same code.
"""

import os
import time

import jax
import keras
import numpy as np

import keras_dist as kd
from tests._helpers import (
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
)

N_TRAIN, N_EVAL, BATCH, EPOCHS = 101, 37, 16, 2  # 101 = 6 * 16 + 5: partial batch.


def _listed(weights) -> list:
    return [np.asarray(w).tolist() for w in weights]


class _Batches(keras.utils.PyDataset):
    """The same global batches as `fit(x, y, batch_size=BATCH, shuffle=False)`."""

    def __init__(self, *arrays):
        super().__init__()
        self.arrays = arrays

    def __len__(self):
        return -(-len(self.arrays[0]) // BATCH)

    def __getitem__(self, index):
        return tuple(a[index * BATCH : (index + 1) * BATCH] for a in self.arrays)


def fit_run(
    strategy,
    workdir: str | None = None,
    *,
    fused: bool = False,
    other_inputs: bool = True,
    keras_backup: bool = False,
) -> dict:
    """fit (NumPy, and with `other_inputs` a PyDataset and tf.data), evaluate
    and predict, with a partial last batch.

    With `fused`, also a fit and predict with `steps_per_execution=3`. With
    `keras_backup` (and `workdir`), Keras's own BackupAndRestore too, and
    what this process finds of the chief's files as `fit` returns.
    """
    x, y, sw = make_data(N_TRAIN)
    weights = initial_weights(batch_norm=True)
    model = build_in_scope(strategy, weights, batch_norm=True)
    callbacks = []
    if workdir is not None:
        rank = jax.process_index()
        callbacks = [
            kd.callbacks.ModelCheckpoint(
                os.path.join(workdir, "ckpt_{epoch}.weights.h5"),
                save_weights_only=True,
            ),
            # Each process writes its parts (asynchronous by default).
            kd.callbacks.ModelCheckpoint(
                os.path.join(workdir, "sharded"), sharded=True
            ),
            kd.callbacks.BackupAndRestore(
                os.path.join(workdir, "backup"), save_freq=3, delete_checkpoint=False
            ),
            keras.callbacks.CSVLogger(os.path.join(workdir, f"log_{rank}.csv")),
        ]
        if keras_backup:  # Keras's own: deletes its backup when training ends.
            backup = keras.callbacks.BackupAndRestore(
                os.path.join(workdir, "keras_backup")
            )
            callbacks.append(backup)
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
    )
    after_fit = {}
    if workdir is not None and keras_backup:  # What each finds as `fit` returns.
        with open(os.path.join(workdir, "log_0.csv")) as f:  # The chief's.
            rows = f.read().strip().splitlines()
        after_fit = {
            "csv_rows": len(rows),
            "last_checkpoint": os.path.isfile(
                os.path.join(workdir, f"ckpt_{EPOCHS}.weights.h5")
            ),
            "keras_backup_deleted": not os.path.exists(
                os.path.join(workdir, "keras_backup")
            ),
            # Keras's own counter, on a follower's object too.
            "keras_backup_epoch": backup._current_epoch,
        }
    evaluation = model.evaluate(
        x[:N_EVAL], y[:N_EVAL], batch_size=BATCH, return_dict=True, verbose=0
    )
    predictions = model.predict(x[:N_EVAL], batch_size=BATCH, verbose=0)
    result = {
        "history": history.history,
        "weights": _listed(model.get_weights()),
        "evaluate": evaluation,
        "predict": predictions.tolist(),
        **({"after_fit": after_fit} if after_fit else {}),
        **(_fused_run(strategy, weights, x, y, sw) if fused else {}),
    }
    if not other_inputs:
        return result

    py_model = build_in_scope(strategy, weights, batch_norm=True)
    py_history = py_model.fit(
        _Batches(x, y, sw), epochs=EPOCHS, shuffle=False, verbose=0
    )

    tf_model = build_in_scope(strategy, weights, batch_norm=True)
    import tensorflow as tf  # Here, not at the top: kill_script.py has none.

    dataset = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(BATCH)
    tf_history = tf_model.fit(dataset, epochs=EPOCHS, verbose=0)

    return {
        **result,
        "py_history": py_history.history,
        "py_weights": _listed(py_model.get_weights()),
        "tf_history": tf_history.history,
        "tf_weights": _listed(tf_model.get_weights()),
    }


def _fused_run(strategy, weights, x, y, sw) -> dict:
    """steps_per_execution=3: groups of 3 full batches run as one program.

    7 batches an epoch: 3 + 3 fused, the partial one through Keras's loop.
    """
    model = build_in_scope(strategy, weights, batch_norm=True)
    with strategy.scope():
        compile_model(model, steps_per_execution=3)
    history = model.fit(
        x,
        y,
        sample_weight=sw,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
    )
    predictions = model.predict(x[:N_EVAL], batch_size=BATCH, verbose=0)
    return {
        "fused_history": history.history,
        "fused_weights": _listed(model.get_weights()),
        "fused_predict": predictions.tolist(),
    }


def sparse_run(strategy) -> dict:
    """fit/evaluate/predict on a scipy.sparse x (a partial last batch)."""
    import scipy.sparse

    x, y, _ = make_data(N_TRAIN)
    x = scipy.sparse.csr_matrix(np.where(np.abs(x) > 0.8, x, 0.0).astype("float32"))
    keras.utils.set_random_seed(11)
    weights = [
        np.random.RandomState(4).uniform(-0.5, 0.5, shape).astype("float32")
        for shape in ((x.shape[1], 8), (8,), (8, 3), (3,))
    ]
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((x.shape[1],), sparse=True),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        model.set_weights(weights)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    evaluation = model.evaluate(x[:N_EVAL], y[:N_EVAL], batch_size=BATCH, verbose=0)
    predictions = model.predict(x[:N_EVAL], batch_size=BATCH, verbose=0)
    return {
        "history": history.history,
        "weights": _listed(model.get_weights()),
        "evaluate": evaluation,
        "predict": predictions.tolist(),
    }


def custom_loop_run(strategy) -> dict:
    """The seeds' custom loop: stateless step in `strategy.run`, SGD + momentum."""
    x, y, _ = make_data(N_TRAIN)
    import tensorflow as tf  # Here, not at the top: kill_script.py has none.

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    distributed = strategy.experimental_distribute_dataset(dataset)
    weights = initial_weights()
    with strategy.scope():
        model = make_model()
        model.set_weights(weights)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )

    def train_step(state, images, labels):
        trainable, non_trainable, opt_vars = state

        def loss_fn(trainable):
            logits, _ = model.stateless_call(trainable, non_trainable, images)
            return kd.losses.compute_average_loss(loss_object(labels, logits)), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, logits, (trainable, non_trainable, opt_vars)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    losses, correct = [], []
    for _ in range(EPOCHS):
        total, batches, right = 0.0, 0, 0
        for images, labels in distributed:
            loss, logits, state = strategy.run(train_step, args=(state, images, labels))
            total += float(strategy.reduce("sum", loss, axis=None))
            batches += 1
            predicted = np.asarray(strategy.gather(logits, axis=0)).argmax(1)
            right += int((predicted == np.asarray(strategy.gather(labels, 0))).sum())
        losses.append(total / batches)
        correct.append(right)
    return {"losses": losses, "correct": correct, "weights": _listed(state[0])}


def _settled(local: str, timeout: float = 60.0) -> None:
    """Waits until every process's local tier holds the same newest step
    and no write in flight (its temporary directories gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = set()
        busy = False
        for entry in sorted(os.listdir(local)):
            names = os.listdir(os.path.join(local, entry))
            busy |= any("tmp" in n for n in names)
            newest.add(max((int(n) for n in names if n.isdigit()), default=-1))
        if not busy and len(newest) == 1:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the local tier in {local} did not settle in {timeout} s")


class _KillAt(keras.callbacks.Callback):
    """A fault after train step `step` of the first run: `how` is "kill"
    (SIGKILL), "stop" (SIGSTOP: frozen, never answering), "hang" (sleeps in
    the loop, its threads alive), each once (a marker file), or "raise" (a
    ValueError every time at that global step: a bug a restart does not
    fix). Several steps: a SIGKILL at each of those global steps, once each
    (failures over the restarts of one run); with as many comma-separated
    `how`s ("kill,stop"), each step's own fault."""

    def __init__(
        self,
        step: "int | tuple",
        marker: str,
        how: str = "kill",
        local: str = "",
        wipe: bool = False,
    ):
        super().__init__()
        self.steps = (step,) if isinstance(step, int) else tuple(step)
        self.marker, self.seen, self.how = marker, 0, how
        self.local = local
        self.wipe = (
            os.path.join(local, f"process_{jax.process_index()}") if wipe else ""
        )

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.how == "raise":  # At the same global step after a restart.
            step = int(np.asarray(self.model.optimizer.iterations.value))
            if step == self.steps[0]:
                raise ValueError(f"a bad batch at step {step}")
            return
        if len(self.steps) == 1:
            due, marker = self.seen == self.steps[0], self.marker
        else:
            step = int(np.asarray(self.model.optimizer.iterations.value))
            due, marker = step in self.steps, f"{self.marker}_{step}"
        if not due or os.path.exists(marker):
            return
        how = self.how
        if "," in how:  # Each step its own fault.
            step = int(np.asarray(self.model.optimizer.iterations.value))
            how = how.split(",")[self.steps.index(step)]
        import signal

        with open(marker, "w") as f:
            f.write(str(time.time()))
        if self.local:  # The local saves made before the fault, on disk.
            _settled(self.local)
        if self.wipe:  # A replaced host: its local tier is gone too.
            import shutil

            shutil.rmtree(self.wipe)
        if how == "hang":
            time.sleep(600)
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


class _PrintSteps(keras.callbacks.Callback):
    """Prints the step on the chief; KD_STEP_SECONDS makes each step that long.

    (JAX's preemption service needs about a second to agree on a step.)
    """

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(float(os.environ.get("KD_STEP_SECONDS", "0")))
        if jax.process_index() == 0:
            step = int(np.asarray(self.model.optimizer.iterations.value))
            print(f"step {step}", flush=True)


def _stepped_input(kind: str, x, y, sw) -> dict:
    """Inputs read with `steps_per_epoch` (see `backup_run`)."""
    import tensorflow as tf  # Here, not at the top: kill_script.py has none.

    shuffled = tf.data.Dataset.from_tensor_slices((x, y, sw)).shuffle(101, seed=3)

    def endless():
        draw = np.random.RandomState(5)
        while True:
            rows = draw.randint(0, len(x), size=BATCH)
            yield x[rows], y[rows], sw[rows]

    return {
        # tf's multi-worker tutorial: a repeated dataset, steps_per_epoch.
        "repeat": {"x": shuffled.batch(BATCH).repeat(), "steps_per_epoch": 5},
        "generator": {"x": endless(), "steps_per_epoch": 5},
        # 7 batches read 3 per epoch: Keras keeps one iterator across epochs.
        "finite-spe": {"x": shuffled.batch(BATCH), "steps_per_epoch": 3},
    }[kind]


def backup_run(
    strategy,
    backup_dir: str,
    kill_at: "int | tuple | None" = None,
    kind: str = "numpy",
    how: str = "kill",
    local: "tuple | None" = None,
    state: "dict | None" = None,
) -> list:
    """3 epochs of 7 steps with backups every 3 steps; may kill itself (`_KillAt`).

    `kind` other than "numpy" reads a tf.data or generator input with
    `steps_per_epoch` (`_stepped_input`). `local`: `(local_save_freq,
    wipe)`: backups at each epoch's end, a local tier in `backup_dir/../local`
    every `local_save_freq` steps (with `wipe`, the killed process deletes its
    own first). `state`, a dict, receives the rest of the final state: the
    optimizer's variables (its step count, Adam's moments) and the last
    epoch's logs (the loss and metrics Keras reports for it, which a resume
    mid-epoch must carry over).
    """
    x, y, sw = make_data(N_TRAIN)
    model = build_in_scope(strategy, initial_weights())
    # Synchronous: a process killed right after a save expects it on disk.
    options: dict = {"save_freq": 3}
    if local is not None:
        local_dir = os.path.join(backup_dir, "..", "local")
        options = {"save_freq": "epoch", "local_dir": local_dir}
        options["local_save_freq"] = local[0]
    backup = kd.callbacks.BackupAndRestore(backup_dir, async_save=False, **options)
    callbacks = [backup, _PrintSteps()]
    if kill_at is not None:
        marker = os.path.join(backup_dir, "..", "killed")
        where = local_dir if local is not None else ""
        wipe = local is not None and local[1]
        callbacks.append(_KillAt(kill_at, marker, how, where, wipe))
    if kind == "numpy":
        inputs = {"x": x, "y": y, "sample_weight": sw, "batch_size": BATCH}
    else:
        inputs = _stepped_input(kind, x, y, sw)
    history = model.fit(
        epochs=3, callbacks=callbacks, shuffle=False, verbose=0, **inputs
    )
    if state is not None:
        state["optimizer"] = _listed(model.optimizer.variables)  # Gathered whole.
        state["last_epoch"] = {k: float(v[-1]) for k, v in history.history.items()}
    return _listed(model.get_weights())


def kill_trial_run(strategy, workdir: str, *, save: bool = True) -> list:
    """12 shuffled epochs of 7 steps, a backup and an async checkpoint each step.

    `workdir/backup` holds the backups, `workdir/ckpts` the `.weights.h5`
    files (`tests/cluster/test_kill_trials.py`); without `save`, the same
    training saving nothing (the reference).
    """
    x, y, sw = make_data(N_TRAIN)
    model = build_in_scope(strategy, initial_weights())
    callbacks = [_PrintSteps()]
    if save:
        callbacks[:0] = [
            kd.callbacks.BackupAndRestore(os.path.join(workdir, "backup"), save_freq=1),
            kd.callbacks.ModelCheckpoint(
                os.path.join(workdir, "ckpts", "ckpt_{epoch}_{batch}.weights.h5"),
                save_weights_only=True,
                save_freq=1,
                max_to_keep=3,
            ),
        ]
    model.fit(
        x, y, sample_weight=sw, batch_size=BATCH, epochs=12, shuffle=True,
        callbacks=callbacks, verbose=0,
    )  # fmt: skip
    return _listed(model.get_weights())
