"""`SidecarEvaluator`: the TF_CONFIG `evaluator` task, on the chief's checkpoints."""

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any

import keras

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.keras_files import atomic_write, atomic_write_json
from keras_dist._checkpoint.pipeline import STATE_FILE
from keras_dist._checks import check_int
from keras_dist.callbacks._lookup import checkpoint_files

__all__ = ["SidecarEvaluator"]

_MAX_MODES = ("acc", "auc", "precision", "recall")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint file and the training epoch (0-based) it was saved at.

    `epoch` is None when the directory has no `ModelCheckpoint` index.
    """

    path: str
    epoch: int | None


class CheckpointWatch:
    """Lists, oldest first, the checkpoints of `directory` not returned before.

    Reads the `checkpoint` index that `kd.callbacks.ModelCheckpoint` keeps
    (files newest last, each one's epoch, and `done` once `fit` ended); a
    directory without a readable index is listed by modification time. A
    file is new when its name, size or modification time changed, so a
    checkpoint rewritten under the same name (`save_best_only`) is new again.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._seen: set[tuple] = set()

    def training_done(self) -> bool:
        """Whether the chief's `fit` has ended (the index says `done`)."""
        return bool(self._index().get("done"))

    def new_checkpoints(self) -> list[Checkpoint]:
        found = []
        for checkpoint in self._listed():
            try:
                key = (checkpoint.path, *storage.signature(checkpoint.path))
            except FileNotFoundError:  # Deleted by `max_to_keep` meanwhile.
                continue
            if key not in self._seen:
                self._seen.add(key)
                found.append(checkpoint)
        return found

    def _index(self) -> dict:
        try:
            index = json.loads(
                storage.read_text(storage.join(self.directory, STATE_FILE))
            )
        except (OSError, ValueError):  # Absent, or being replaced: none yet.
            return {}
        return index if isinstance(index, dict) else {}

    def _listed(self) -> list[Checkpoint]:
        index = self._index()
        names = index.get("all")
        if isinstance(names, list) and names:
            epochs = index.get("epochs") or {}
            return [
                Checkpoint(storage.join(self.directory, name), epochs.get(name))
                for name in names
                if isinstance(name, str)
            ]
        return [Checkpoint(path, None) for path in checkpoint_files(self.directory)]


class SidecarEvaluator:
    """Evaluates every new checkpoint of a training run, beside it.

    `tf.keras.utils.SidecarEvaluator` for keras_dist: a process outside the
    training cluster (the TF_CONFIG `evaluator` task; `keras-dist-run
    --evaluator` starts one) watches the checkpoints the chief's
    `kd.callbacks.ModelCheckpoint` writes to `checkpoint_dir`, loads each new
    one once (`.weights.h5` or `.keras`, into `model`), evaluates it on
    `data` and:

    - passes the metrics to `callbacks` as one epoch, numbered by the
      training epoch of the checkpoint (`keras.callbacks.CSVLogger` writes a
      row per checkpoint, `keras.callbacks.TensorBoard` a point);
    - keeps the best: a copy of the best checkpoint by `monitor` in
      `best_dir` (`best.weights.h5` or `best.keras`), with `best.json`
      naming its source, epoch and value;
    - stops after `max_evaluations`, once training is done (the index's
      `done` marker, written when the chief's `fit` ends) and every
      checkpoint was evaluated, or when no new checkpoint appeared for
      `idle_timeout` seconds.

    Checkpoints are evaluated in the order they were written, each exactly
    once (a file rewritten under the same name counts as new); one deleted
    by `max_to_keep` before its turn is skipped.

    Example:

    ```python
    resolver = kd.cluster.resolve()
    if resolver.task_type == "evaluator":
        model = make_model()
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        kd.callbacks.SidecarEvaluator(
            model, eval_ds, "ckpts",
            callbacks=[keras.callbacks.CSVLogger("eval.csv")],
        ).start()
    ```

    Args:
        model: a compiled model of the architecture being trained.
        data: what `model.evaluate` takes: a `tf.data.Dataset`, a
            `PyDataset`, or a tuple `(x, y)` / `(x, y, sample_weight)`.
        checkpoint_dir: the directory of the chief's checkpoints.
        steps: evaluation steps per checkpoint. Defaults to `None`: all of
            `data`.
        max_evaluations: stop after this many evaluations. Defaults to
            `None`: until training is done.
        callbacks: Keras callbacks that get `on_epoch_end(epoch, metrics)`
            for every checkpoint (and `on_train_begin`/`on_train_end` once).
        monitor: the metric that picks the best checkpoint. Defaults to
            `"loss"`.
        mode: `"min"`, `"max"`, or `"auto"` (max for accuracy, AUC,
            precision and recall, min otherwise). Defaults to `"auto"`.
        best_dir: where the best checkpoint is copied; `None` keeps none.
            Defaults to `<checkpoint_dir>/best`.
        idle_timeout: seconds without a new checkpoint before stopping.
            Defaults to 600.
        poll_interval: seconds between looks at `checkpoint_dir`. Defaults
            to 1.

    Raises:
        ValueError: for a model that is not compiled or a bad option.
        TypeError: for seconds that are not a number.
        TimeoutError: (from `start`) if no checkpoint at all appeared within
            `idle_timeout` seconds.
    """

    def __init__(
        self,
        model: keras.Model,
        data: Any,
        checkpoint_dir: str | os.PathLike,
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks: list | None = None,
        *,
        monitor: str = "loss",
        mode: str = "auto",
        best_dir: str | None = "default",
        idle_timeout: float = 600.0,
        poll_interval: float = 1.0,
    ):
        if not isinstance(model, keras.Model) or not model.compiled:
            raise ValueError(
                "`model` must be a compiled keras.Model (evaluation needs its loss "
                f"and metrics). Received: model={model!r}. Call `model.compile(loss="
                "..., metrics=[...])` first."
            )
        if steps is not None:
            steps = check_int(steps, name="steps", meaning=" or None")
        if max_evaluations is not None:
            max_evaluations = check_int(
                max_evaluations, name="max_evaluations", meaning=" or None"
            )
        _check_seconds("idle_timeout", idle_timeout)
        _check_seconds("poll_interval", poll_interval)
        self.model = model
        self.data = data
        self.checkpoint_dir = storage.check(checkpoint_dir, argument="checkpoint_dir")
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = keras.callbacks.CallbackList(
            list(callbacks or []), model=model
        )
        self.monitor = monitor
        self.mode = _resolve_mode(mode, monitor)
        if best_dir == "default":
            best_dir = storage.join(self.checkpoint_dir, "best")
        self.best_dir = (
            None if best_dir is None else storage.served(best_dir, argument="best_dir")
        )
        self.idle_timeout = float(idle_timeout)
        self.poll_interval = float(poll_interval)
        self.history: list[dict] = []
        self.best: dict | None = None

    def start(self) -> None:
        """Evaluates checkpoints until one of the stop conditions holds.

        `history` then lists every evaluation (`checkpoint`, `epoch`,
        `metrics`); `best` is the best of them.

        Raises:
            TimeoutError: if no checkpoint appeared within `idle_timeout`.
        """
        watch = CheckpointWatch(self.checkpoint_dir)
        self.callbacks.on_train_begin()
        try:
            self._loop(watch)
        finally:
            self.callbacks.on_train_end()

    def _loop(self, watch: CheckpointWatch) -> None:
        last_new = time.monotonic()
        while not self._enough():
            done = watch.training_done()  # Read before listing: no race.
            new = watch.new_checkpoints()
            for checkpoint in new:
                if self._enough():
                    return
                self._evaluate(checkpoint)
            if new:
                last_new = time.monotonic()
            elif done:
                return
            elif time.monotonic() - last_new > self.idle_timeout:
                self._idle()
                return
            else:
                time.sleep(self.poll_interval)

    def _enough(self) -> bool:
        return (
            self.max_evaluations is not None
            and len(self.history) >= self.max_evaluations
        )

    def _idle(self) -> None:
        if not self.history:
            raise TimeoutError(
                f"SidecarEvaluator: no checkpoint appeared in {self.checkpoint_dir} "
                f"within idle_timeout={self.idle_timeout:g} s. Check that "
                "`checkpoint_dir` is the directory of the chief's ModelCheckpoint "
                "and that training is running (or raise `idle_timeout`)."
            )
        print(
            f"SidecarEvaluator: no new checkpoint for {self.idle_timeout:g} s "
            f"after {len(self.history)} evaluation(s); stopping.",
            file=sys.stderr,
            flush=True,
        )

    def _evaluate(self, checkpoint: Checkpoint) -> None:
        if not storage.exists(checkpoint.path):  # Deleted by `max_to_keep`.
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)  # Loads its state too.
        try:
            with storage.download(checkpoint.path) as local:
                self.model.load_weights(local)
        except FileNotFoundError:  # Deleted by `max_to_keep` meanwhile.
            return
        epoch = len(self.history) if checkpoint.epoch is None else checkpoint.epoch
        self.callbacks.on_epoch_begin(epoch)
        x, y, sample_weight = self.data, None, None
        if isinstance(self.data, tuple):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(self.data)
        metrics = self.model.evaluate(
            x,
            y,
            sample_weight=sample_weight,
            steps=self.steps,
            verbose=0,
            return_dict=True,
        )
        metrics = {name: float(value) for name, value in metrics.items()}
        self.callbacks.on_epoch_end(epoch, dict(metrics))
        record = {"checkpoint": checkpoint.path, "epoch": epoch, "metrics": metrics}
        self.history.append(record)
        print(
            f"SidecarEvaluator: {storage.basename(checkpoint.path)} (epoch "
            f"{epoch}): " + ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()),
            flush=True,
        )
        if self._is_better(metrics):
            self.best = record
            self._keep_best(checkpoint, record)

    def _is_better(self, metrics: dict) -> bool:
        if self.monitor not in metrics:
            raise ValueError(
                f"SidecarEvaluator: `monitor={self.monitor!r}` is not among the "
                f"evaluation metrics {sorted(metrics)}. Pass one of them as "
                "`monitor`."
            )
        if self.best is None:
            return True
        value, best = metrics[self.monitor], self.best["metrics"][self.monitor]
        return value < best if self.mode == "min" else value > best

    def _keep_best(self, checkpoint: Checkpoint, record: dict) -> None:
        if self.best_dir is None:
            return
        suffix = ".keras" if checkpoint.path.endswith(".keras") else ".weights.h5"
        copy = storage.join(self.best_dir, "best" + suffix)
        with storage.download(checkpoint.path) as local:
            atomic_write(copy, lambda p: shutil.copyfile(local, p))
        value = record["metrics"][self.monitor]
        summary = {**record, "monitor": self.monitor, "value": value}
        atomic_write_json(storage.join(self.best_dir, "best.json"), summary)


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"`{name}` must be a number of seconds. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if not value > 0:
        raise ValueError(f"`{name}` must be > 0 seconds. Received: {name}={value!r}.")


def _resolve_mode(mode: str, monitor: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(
            f'`mode` must be "auto", "min" or "max". Received: mode={mode!r}.'
        )
    if mode == "auto":
        return "max" if any(k in monitor for k in _MAX_MODES) else "min"
    return mode
