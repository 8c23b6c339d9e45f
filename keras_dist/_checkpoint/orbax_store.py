"""The engine of Orbax checkpoints: a model's numbered steps, and loading them.

Orbax's `training.Checkpointer` (its v1 API) in `keras.callbacks.OrbaxCheckpoint`'s
layout: a directory per step; the checkpointable `pytree` holds
`model.get_state_tree()`'s groups (`model_config` and `assets` beside it for
a full model), which Keras's loaders read; `keras_dist` holds the variables'
paths in the model's order (a load need not match names) and a backup's
`meta`. Orbax writes, commits a step by a rename once every process has
written, keeps what `keep_policy` says and deletes half-written steps.
Arrays are written uncompressed (a trained state's bytes look random: zstd
saves few and takes CPU the host shares with training); with one process,
without replica-parallel slicing (a device copy per replica, for nothing).
"""

import functools
import json
import os
import threading
import zlib
from typing import Any

import jax
import numpy as np

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.freeze import freeze, prepare
from keras_dist._private_api import _private
from keras_dist._private_api._orbax_private import without_preemption_queries
from keras_dist._version import __version__
from keras_dist.errors import IncompatibleBackupError

__all__ = [
    "OrbaxStore",
    "Saving",
    "committed_steps",
    "keep_policy",
    "preserved",
    "restore",
]

_ONE_ORBAX_SAVE = threading.Lock()

# `model.get_state_tree()`'s groups, in its order.
GROUPS = {
    "trainable_variables": lambda m: m.trainable_variables,
    "non_trainable_variables": lambda m: m.non_trainable_variables,
    "optimizer_variables": lambda m: m.optimizer.variables if m.optimizer else [],
    "metrics_variables": lambda m: m.metrics_variables,
}
WEIGHTS = ("trainable_variables", "non_trainable_variables")
ORDER = "keras_dist"  # The checkpointable of the paths (and a backup's meta).
# The layout of what this keras_dist writes (CHANGELOG.md): Orbax's v1
# checkpointables, `pytree` in Keras's state-tree groups, this record. A new
# value comes with a new keras_dist version; another one is refused, named.
FORMAT = "keras_dist.orbax/2"


@functools.cache
def _ocp():
    import orbax.checkpoint as ocp

    # Orbax's private names keras_dist uses, checked at its first use (not
    # at `import keras_dist`, which leaves Orbax unimported).
    missing = _private.check("orbax")
    if missing:
        raise ImportError(
            f"keras_dist: orbax-checkpoint {ocp.__version__} no longer has "
            f"{missing}; keras_dist is tested with orbax-checkpoint 0.11 and "
            "0.12: install one of those."
        )
    return ocp.v1


def keep_policy(max_to_keep: int | None, keep_period: int | None):
    """Orbax's preservation policy for `max_to_keep` / `keep_period`: the
    newest `max_to_keep` checkpoints and every step that is a multiple of
    `keep_period` (neither: every step kept)."""
    policies = _ocp().training.preservation_policies
    kept = [policies.LatestN(max_to_keep)] if max_to_keep else []
    if keep_period:
        kept.append(policies.EveryNSteps(keep_period))
    if len(kept) > 1:
        return policies.AnyPreservationPolicy(kept)
    return kept[0] if kept else policies.PreserveAll()


def preserved(policy: Any, checkpoints: list) -> list[bool]:
    """Which of `checkpoints` (oldest first; each with `step` and `time`)
    `policy` keeps."""
    context = _ocp().training.preservation_policies.PreservationContext()
    return list(policy.should_preserve(checkpoints, context=context))


class Saving:
    """Orbax's save in flight, as the pipeline's `Writer` watches one:
    `saving()` tells whether it is, `wait()` waits and raises its error."""

    def __init__(self, saving, wait):
        self.done = lambda: not saving()
        self.result = wait


class OrbaxStore:
    """Numbered Orbax checkpoints of a model in `directory`.

    `keep`: Orbax's preservation policy (`keep_policy`). `owner` names the
    store's barriers. `process_local`: this process alone writes and reads
    `directory` (the local tier's, `local_tier.py`).
    """

    def __init__(
        self, directory: str, *, owner: str, keep: Any, process_local: bool = False
    ):
        ocp = _ocp()
        # Two stores saving at once in several processes (a backup and a
        # sharded checkpoint at the same step) each run Orbax's barriers from
        # their commit threads: Orbax's documented prefix keeps them apart.
        context = ocp.Context()  # Configured by attribute, as Orbax asks.
        context.multiprocessing.barrier_sync_key_prefix = (
            f"{owner}_{zlib.crc32(directory.encode())}_"
        )
        if process_local:  # Orbax's options for storage only this host sees:
            # every process primary (writes its metadata, commits, deletes),
            # the barriers the others' (every process saves the same steps).
            context.multiprocessing.primary_host = None
            context.multiprocessing.barrier_sync_key_prefix = f"{owner}_"
        self.context = context
        # The record of paths (and a backup's meta) and Keras's model config
        # are JSON: Orbax's JSON handler writes each as one file, where its
        # array handler would run an OCDBT merge with no arrays to merge (and
        # warn at every save).
        registry = ocp.handlers.local_registry(include_global_registry=True)
        for name in (ORDER, "model_config"):
            registry.add(ocp.handlers.JsonHandler, checkpointable_name=name)
        context.checkpointables.registry = registry
        saving = context.array.saving
        saving.use_compression = False
        saving.use_replica_parallel = jax.process_count() > 1 and not process_local
        self.directory = directory
        self._checkpointer = ocp.training.Checkpointer(
            directory,
            context=context,
            preservation_policy=keep,
            save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(
                1
            ),
            cleanup_tmp_directories=True,
        )
        # With several processes Orbax asks JAX's preemption service at each
        # save, also from its commit thread with the step it saved: the
        # processes could agree on a step the training thread has passed
        # (`_orbax_private.py`). One process has none to disagree with (and
        # keras_dist's SIGTERM handler, not the service, sees its preemption).
        if jax.process_count() > 1:
            without_preemption_queries(self._checkpointer)
        self._refuse_earlier_formats()

    def prepare(self, model, groups: tuple = tuple(GROUPS)) -> None:
        """Compiles the copies a save of `groups` dispatches, now (when `fit`
        begins), not on the training thread at the first save."""
        if jax.process_count() == 1:
            state = model.get_state_tree()
            prepare(jax.tree.leaves({g: state[g] for g in groups}))

    def steps(self) -> list[int]:
        return sorted(c.step for c in self._checkpointer.checkpoints)

    def payload(
        self,
        model,
        *,
        groups: tuple = tuple(GROUPS),
        files: dict | None = None,
        meta: dict | None = None,
    ) -> dict:
        """What a save of `groups` of `model`'s state tree writes (with
        `files`: Keras's JSON and assets; with `meta`: a backup's)."""
        state = model.get_state_tree()
        paths = {g: [v.path for v in GROUPS[g](model)] for g in groups}
        record = {
            "paths": json.dumps(paths),
            "format": FORMAT,
            "written_by": f"keras_dist {__version__}",
        }
        if meta is not None:
            record["meta"] = json.dumps(meta)
        payload = {"pytree": {g: state[g] for g in groups}, ORDER: record}
        if files:
            payload.update(files)
        return payload

    def frozen(self, payload: dict) -> dict:
        """`payload` with its state as a snapshot on the devices (one
        process: `save` then writes it on another thread)."""
        leaves, tree = jax.tree.flatten(payload["pytree"])
        return payload | {"pytree": jax.tree.unflatten(tree, freeze(leaves))}

    def save(self, step: int, payload: dict) -> None:
        """Orbax's synchronous save of `payload` as `step` (a `frozen` one)."""
        # Orbax's saves share process-wide state (its operation ids, the
        # temporary directories they name): two at once from two writer
        # threads (a backup and a sharded checkpoint of one step) collide.
        with _ONE_ORBAX_SAVE:
            self._checkpointer.save_checkpointables(step, payload)

    def save_async(self, step: int, payload: dict) -> Saving:
        """Orbax's asynchronous save (several processes: it runs collectives,
        on the training thread); the returned save is in flight."""
        self._checkpointer.save_checkpointables_async(step, payload)
        checkpointer = self._checkpointer  # Its wait raises the save's error.
        return Saving(checkpointer.is_saving_in_progress, checkpointer.wait)

    def close(self) -> None:
        self._checkpointer.close()

    def load(self, step: int, abstract: dict | None = None) -> dict:
        """Orbax's load of `abstract`'s checkpointables of `step` (None:
        all, as saved)."""
        return self._checkpointer.load_checkpointables(step, abstract)

    def reload(self) -> None:
        """Reads the directory's steps again (after a deletion of its own)."""
        self._checkpointer.reload()

    def restore(self, model) -> dict | None:
        """Loads the newest readable backup into `model`; returns its meta
        (None: there is none). A backup that cannot be read is reported and
        the previous one tried.

        Raises:
            IncompatibleBackupError: the backup was written by another model.
            RuntimeError: no backup can be read.
        """
        import warnings

        steps = self.steps()
        for step in reversed(steps):
            path = storage.join(self.directory, str(step))
            try:
                meta, values = restore(model, path, backup=True)
            except IncompatibleBackupError:
                raise
            except Exception as error:  # A torn or corrupt backup: an older one.
                warnings.warn(
                    f"BackupAndRestore: the backup of step {step} in "
                    f"{self.directory} cannot be read ({type(error).__name__}: "
                    f"{str(error)[:200]}); trying the previous one.",
                    stacklevel=3,
                )
                continue
            meta["metrics_values"] = values
            return meta
        if steps:
            raise RuntimeError(
                f"BackupAndRestore: none of the backups {steps} in "
                f"{self.directory} can be read. Delete the directory to start "
                "from scratch."
            )
        return None

    def _refuse_earlier_formats(self) -> None:
        """A backup of keras_dist 0.1 (one process: `arrays/`, its own raw
        format; several: Orbax's v0 `state` item) is refused, not misread."""
        for name in storage.listdir(self.directory):
            step = storage.join(self.directory, name)
            if name.isdigit() and any(
                storage.isdir(storage.join(step, item)) for item in ("arrays", "state")
            ):
                raise IncompatibleBackupError(
                    f"The checkpoint {step} is in a format of keras_dist "
                    "0.1 (`arrays/`: keras_dist.raw_arrays/1; `state/`: an "
                    "Orbax v0 item), which this keras_dist "
                    f"{__version__} does not read: since 0.2.0 it writes "
                    f"{FORMAT} (Orbax's v1 layout; CHANGELOG.md). Finish that "
                    "run with the keras_dist that wrote it, or delete the "
                    "directory to start from scratch."
                )


def committed_steps(directory: str) -> list[int]:
    """The committed Orbax checkpoints of `directory`: on a disk a step's
    directory is renamed to its number once complete; on a bucket (no
    rename) it has Orbax's `commit_success.txt`, written last."""
    if not storage.is_remote(directory):
        if not os.path.isdir(directory):
            return []
        return [
            int(entry.name)
            for entry in os.scandir(directory)
            if entry.name.isdigit() and entry.is_dir()
        ]
    return [
        int(name)
        for name in storage.listdir(directory)
        if name.isdigit()
        and storage.exists(storage.join(directory, name, "commit_success.txt"))
    ]


def _step_directory(path: str) -> str:
    steps = committed_steps(path)
    return storage.join(path, str(max(steps))) if steps else path


def _leaf(tree, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _put(tree: dict, path: str, value) -> None:
    *parents, name = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[name] = value


def _mismatch(backup: bool, message: str) -> Exception:
    if backup:
        return IncompatibleBackupError(
            f"{message} Resume with the model that wrote the backup, or delete "
            "the directory."
        )
    return ValueError(f"{message} Load it into the model that wrote it.")


def restore(model, path: str, *, backup: bool = False):
    """Loads an Orbax checkpoint (a directory of steps: the newest; or a
    step's directory) into `model`.

    Variables are matched by their order in the model, as the checkpoint's
    `keras_dist` record lists them, so names may differ from the saving
    run's; a checkpoint of Keras's `OrbaxCheckpoint` (no record) is matched
    by names, as Keras does. Each value is read in the layout of the
    variable it goes to (another mesh, number of processes or one device).
    An optimizer not built yet is built first. With `backup`, returns
    `(meta, metrics values)` (`fit` resets the metrics: `BackupAndRestore`
    assigns them again when the epoch begins); otherwise metrics not built
    yet are left as they are.

    Raises:
        ValueError (IncompatibleBackupError with `backup`): the checkpoint
            does not fit the model, naming the first variable that differs.
    """
    ocp = _ocp()
    step_dir = _step_directory(storage.check(path, argument="path"))
    record = None
    if storage.isdir(storage.join(step_dir, ORDER)):
        record = ocp.load_checkpointables(step_dir, {ORDER: None})[ORDER]
    if record and record.get("format", FORMAT) != FORMAT:
        raise _mismatch(
            backup,
            f"The checkpoint {step_dir} is in the format {record['format']}, "
            f"written by {record.get('written_by', 'another keras_dist')}; this "
            f"keras_dist {__version__} reads {FORMAT}.",
        )
    order = json.loads(record["paths"]) if record else None
    saved = ocp.pytree_metadata(step_dir, checkpointable_name="pytree").metadata
    optimizer = getattr(model, "optimizer", None)
    if "optimizer_variables" in saved and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    abstract: dict = {}
    targets = []
    for group in (g for g in GROUPS if g in saved):  # The model's order.
        leaves = saved[group]
        abstract[group] = {}  # Orbax reads whole trees: every group, every leaf.
        variables = list(GROUPS[group](model))
        names = order[group] if order else [v.path for v in variables]
        if not backup and group == "metrics_variables" and len(names) != len(variables):
            # Metrics not built yet: their sums are read, not kept.
            everywhere = jax.sharding.NamedSharding(
                jax.sharding.Mesh(np.array(jax.devices()), ("all",)),
                jax.sharding.PartitionSpec(),
            )
            abstract[group] = jax.tree.map(
                lambda m, s=everywhere: jax.ShapeDtypeStruct(
                    m.shape, m.dtype, sharding=s
                ),
                leaves,
            )
            continue
        where = "backup" if backup else "checkpoint"
        for variable, name in zip(variables, names, strict=False):
            try:
                meta = _leaf(leaves, name)
            except (KeyError, TypeError):
                raise _mismatch(
                    backup,
                    f"The {where} {step_dir} has no {group} {name!r} (this "
                    f"model's {variable.path!r}). Keras's OrbaxCheckpoint matches "
                    "variables by name: build the model as the saving script did.",
                ) from None
            if tuple(meta.shape) != tuple(variable.shape):
                raise _mismatch(
                    backup,
                    f"The {where} in {path} does not fit this model: variable "
                    f"{variable.path!r} has shape {tuple(variable.shape)} but the "
                    f"{where}'s {name!r} has shape {tuple(meta.shape)}.",
                )
            key = f"{group}/{name}"
            _put(
                abstract,
                key,
                jax.ShapeDtypeStruct(
                    meta.shape, meta.dtype, sharding=variable.value.sharding
                ),
            )
            targets.append((variable, key, group))
        if len(names) != len(variables):
            raise _mismatch(
                backup,
                f"The {where} in {path} does not fit this model: it has "
                f"{len(names)} {group}, the model {len(variables)}.",
            )
    loaded = ocp.load_checkpointables(step_dir, {"pytree": abstract})["pytree"]
    metrics = []
    for variable, key, group in targets:
        variable.assign(_leaf(loaded, key))
        if group == "metrics_variables":
            metrics.append(np.asarray(_leaf(loaded, key)))
    if not backup:
        return None
    return (json.loads(record["meta"]) if record and "meta" in record else {}), metrics
