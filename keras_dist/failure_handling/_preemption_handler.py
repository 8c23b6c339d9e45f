"""`PreemptionCheckpointHandler`: a custom loop saves at one agreed step and exits."""

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import keras

from keras_dist._checkpoint.orbax_store import GROUPS
from keras_dist._checkpoint.pipeline import (
    TwoTierSaves,
    check_shared,
    check_writable_dir,
)
from keras_dist._checks import check_int
from keras_dist.callbacks._chief import is_chief
from keras_dist.cluster import _heartbeat, _sync
from keras_dist.cluster._environment import resolve
from keras_dist.cluster._preemption import PreemptionNotice
from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.failure_handling._termination_config import TerminationConfig

__all__ = ["PreemptionCheckpointHandler"]


class _Manager(Protocol):
    """What saves and restores for `PreemptionCheckpointHandler`."""

    def save(self, number: int, meta: dict) -> None: ...

    def restore(self) -> dict | None: ...


# Not the metrics: a custom loop builds them in its first step, after the
# restore, and `train_on_batch` resets them every step.
_GROUPS = tuple(g for g in GROUPS if g != "metrics_variables")


class _ModelState:
    """The default manager: a model's state in Orbax checkpoints.

    Its weights and the variables of `model.optimizer` (built here if it is
    not yet), in the two tiers `kd.callbacks.BackupAndRestore` keeps
    (`pipeline.TwoTierSaves`: numbered, atomic, the previous one kept).
    Not the metrics: a custom loop builds them in its first step, after the
    restore, and `train_on_batch` resets them every step.
    """

    def __init__(self, model: keras.Model, directory: str, local_dir: str | None):
        self.model = model
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        check_shared(
            directory, argument="checkpoint_dir", owner="PreemptionCheckpointHandler"
        )
        # Synchronous: it saves right before the process exits, which must
        # wait for the files anyway (with a grace period, its first save
        # waits too: a few runs of training are not worth a second road).
        self._tiers = TwoTierSaves(
            directory,
            local_dir,
            owner="PreemptionCheckpointHandler",
            async_save=False,
            groups=_GROUPS,
        )

    def save(self, number: int, meta: dict) -> None:
        self._tiers.save(self.model, number, meta=meta)

    def save_local(self, number: int, meta: dict) -> None:
        """A save to the local tier (in the background), if there is one."""
        self._tiers.save(self.model, number, meta=meta, local=True)

    def restore(self) -> dict | None:
        return self._tiers.restore(self.model)

    def close(self) -> None:
        self._tiers.close()  # Finishes a local save in flight.


def _manager(
    checkpoint_or_manager: Any,
    checkpoint_dir: "str | os.PathLike | None",
    local_dir: "str | os.PathLike | None",
) -> _Manager:
    if isinstance(checkpoint_or_manager, keras.Model):
        if checkpoint_dir is None:
            raise ValueError(
                "`checkpoint_dir` is needed to save a keras.Model. Received: "
                "checkpoint_dir=None. Pass a directory, e.g. "
                "`PreemptionCheckpointHandler(None, model, '/tmp/ckpt')`."
            )
        directory = check_writable_dir(
            os.fspath(checkpoint_dir), argument="checkpoint_dir", orbax=True
        )
        local = None
        if local_dir is not None:
            local = check_writable_dir(
                os.fspath(local_dir), argument="local_dir", local=True
            )
        return _ModelState(checkpoint_or_manager, directory, local)
    if callable(getattr(checkpoint_or_manager, "save", None)) and callable(
        getattr(checkpoint_or_manager, "restore", None)
    ):
        return checkpoint_or_manager
    raise TypeError(
        "`checkpoint_or_manager` must be a keras.Model (its weights, optimizer "
        "and metrics are saved to `checkpoint_dir`) or a manager with "
        "`save(number: int, meta: dict)` and `restore() -> dict | None`. "
        f"Received: {type(checkpoint_or_manager).__name__}."
    )


class PreemptionCheckpointHandler:
    """Saves a custom loop's state when the job is preempted; resumes exactly.

    tf's `tf.distribute.experimental.PreemptionCheckpointHandler` on JAX:
    wrap each training step in `run`. When any process is told to stop
    (SIGTERM, or `TerminationConfig.termination_watcher_fn`), every process
    stops at the same run — agreed through JAX's preemption sync point
    (`multihost_utils.reached_preemption_sync_point`), which needs the
    cluster joined (`kd.cluster.initialize()` or a multi-worker strategy);
    with one process SIGTERM is caught locally — saves a checkpoint together
    with `total_run_calls`, and calls `exit_fn`. Created again after the
    restart, the handler restores the newest checkpoint and
    `total_run_calls`; a loop that picks its input by `total_run_calls`
    then ends with the weights of an uninterrupted run.

    `checkpoint_or_manager` is either a `keras.Model` — its weights and the
    variables of `model.optimizer` and of its metrics are saved as
    `BackupAndRestore`'s backups (Orbax checkpoint steps) in
    `checkpoint_dir` (so the loop must keep its state in the model's
    variables: `train_on_batch`, or assigning the results of a
    stateless step back) — or any manager object with `save(number, meta)`
    and `restore() -> meta | None` (the meta dict holds `total_run_calls`),
    in which case `checkpoint_dir` is not used.

    Example:

    ```python
    handler = kd.PreemptionCheckpointHandler(None, model, "/tmp/ckpt")
    while handler.total_run_calls < STEPS:
        step = handler.total_run_calls
        handler.run(model.train_on_batch, x[step * B:(step + 1) * B], ...)
    ```

    Args:
        cluster_resolver: a `kd.cluster.ClusterResolver`, or `None` to
            resolve it from the environment.
        checkpoint_or_manager: a `keras.Model` or a manager (see above).
        checkpoint_dir: where a model's checkpoints go.
        termination_config: a `kd.TerminationConfig`. Defaults to SIGTERM as
            the notice, `sys.exit(42)`, no grace period.
        local_dir: with a model: a local tier, as `kd.callbacks.
            BackupAndRestore`'s (storage each host has to itself): every
            `local_save_freq` runs each process writes its parts of the state
            to `local_dir/process_<p>` in the background; a restarted handler
            (after a process was killed, not only preempted) restores the
            newest backup of either tier it can restore exactly. Defaults to
            None.
        local_save_freq: runs between local saves. Defaults to 10.

    Raises:
        ValueError: for a model without `checkpoint_dir`, or a process that
            is not part of the training cluster (a TF_CONFIG evaluator).
        TypeError: for a `checkpoint_or_manager` or `termination_config` of
            another type.
        PermissionError: if `checkpoint_dir` is not writable.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None,
        checkpoint_or_manager: "keras.Model | Any",
        checkpoint_dir: "str | os.PathLike | None" = None,
        termination_config: TerminationConfig | None = None,
        *,
        local_dir: "str | os.PathLike | None" = None,
        local_save_freq: int = 10,
    ):
        self.cluster_resolver = resolve(cluster_resolver)
        if self.cluster_resolver.process_id is None and (
            self.cluster_resolver.source != "jax"
        ):
            raise ValueError(
                "PreemptionCheckpointHandler runs in the training processes, but "
                f"this one is {self.cluster_resolver.task_type}:"
                f"{self.cluster_resolver.task_id}, outside the training cluster. "
                "Create it only in the chief and workers."
            )
        if termination_config is None:
            termination_config = TerminationConfig()
        if not isinstance(termination_config, TerminationConfig):
            raise TypeError(
                "`termination_config` must be a kd.TerminationConfig or None. "
                f"Received: {type(termination_config).__name__}."
            )
        self.termination_config = termination_config
        self._local_freq = check_int(
            local_save_freq, name="local_save_freq", meaning=" (runs)"
        )
        if local_dir is not None and not isinstance(checkpoint_or_manager, keras.Model):
            raise ValueError(
                "`local_dir` is for the checkpoints of a keras.Model; a manager "
                "saves where it saves. Received: local_dir="
                f"{os.fspath(local_dir)!r} with a "
                f"{type(checkpoint_or_manager).__name__}."
            )
        self._manager = _manager(checkpoint_or_manager, checkpoint_dir, local_dir)
        self._run_counter = 0
        self._run_seconds: float | None = None
        self._final_run: int | None = None
        self._watcher_fired = False
        self._notice = PreemptionNotice()
        meta = self._manager.restore()
        if meta is not None:
            self._run_counter = int(meta["total_run_calls"])
            _heartbeat.set_step(self._run_counter)
            if is_chief():
                print(
                    "PreemptionCheckpointHandler: restored the checkpoint of run "
                    f"{self._run_counter}.",
                    flush=True,
                )
        self._notice.install()

    @property
    def total_run_calls(self) -> int:
        """How many times `run` was called, including before a restart."""
        return self._run_counter

    def run(
        self, distributed_train_function: Callable, *args: Any, **kwargs: Any
    ) -> Any:
        """Calls `distributed_train_function(*args, **kwargs)`; saves if preempted.

        Returns:
            What the function returns (unless the process exits here).
        """
        start = time.monotonic()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        _heartbeat.PROGRESS.step += 1  # The launcher's heartbeat counts runs.
        _heartbeat.PROGRESS.progress += 1
        seconds = time.monotonic() - start
        if self._run_seconds is not None:  # A moving average of a run's time.
            seconds = 0.8 * self._run_seconds + 0.2 * seconds
        self._run_seconds = seconds
        if (
            isinstance(self._manager, _ModelState)
            and self._run_counter % self._local_freq == 0
        ):
            self._manager.save_local(
                self._run_counter, {"total_run_calls": self._run_counter}
            )
        self.save_checkpoint_if_preempted()
        return result

    def save_checkpoint_if_preempted(self) -> None:
        """Saves (and exits) if this is the agreed step; otherwise nothing.

        For loops that do not go through `run`: call it once per step, on
        every process, after `total_run_calls` moved (it is only counted by
        `run`).
        """
        if self._final_run is not None:
            if self._run_counter >= self._final_run:
                self._save()
                self._final_run = None
                self._exit()
            return
        if not self._preemption_reached():
            return
        save_seconds = self._save()
        grace = self.termination_config.grace_period
        extra = 0
        if grace:
            budget = grace - 2 * save_seconds  # The final save, with a margin.
            per_run = max(self._run_seconds or 0.0, 1e-6)
            extra = _sync.broadcast_from_chief(
                "preemption-grace-runs", max(0, int(budget // per_run))
            )
        if extra > 0:
            self._final_run = self._run_counter + extra
        else:
            self._exit()

    def close(self) -> None:
        """Finishes a local save in flight; gives SIGTERM back to its
        previous handler (one process only)."""
        try:
            if isinstance(self._manager, _ModelState):
                self._manager.close()
        finally:
            self._notice.uninstall()

    # Notice -------------------------------------------------------------

    def _preemption_reached(self) -> bool:
        watcher = self.termination_config.termination_watcher_fn
        if watcher is not None and not self._watcher_fired and watcher():
            self._watcher_fired = True
            self._notice.notify()
        # Every process passes the same growing run numbers.
        return self._notice.reached(self._run_counter)

    # Save and exit ------------------------------------------------------

    def _save(self) -> float:
        start = time.monotonic()
        self._manager.save(self._run_counter, {"total_run_calls": self._run_counter})
        if self.termination_config.save_fn is not None:
            self.termination_config.save_fn()
        if is_chief():
            print(
                "PreemptionCheckpointHandler: preempted; saved run "
                f"{self._run_counter}.",
                flush=True,
            )
        return time.monotonic() - start

    def _exit(self) -> None:
        """Calls `exit_fn`; if it returns, training goes on (notice cleared)."""
        self._notice.clear()
        self.termination_config.exit()
