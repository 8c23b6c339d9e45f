"""`ShardedCheckpoints`: `ModelCheckpoint(sharded=True)`'s Orbax directory.

The layout is `keras.callbacks.OrbaxCheckpoint`'s (a directory per step,
checkpointables `pytree` and `model_config`), so `keras.models.load_model`
and `model.load_weights` read it, and `kd.callbacks.ModelCheckpoint` and
Keras's callback read each other's. Each process writes the parts of the
state it holds (nothing is gathered on one host); Orbax commits a step by
a rename once every part is written. An asynchronous save freezes the
state (`freeze`) and runs Orbax's save on keras_dist's writer thread, with
several processes too (Orbax's barriers then go through JAX's coordination
service: `_orbax.py`).
"""

import json
import os

import jax
import numpy as np

from keras_dist._keras_compat._freeze import freeze
from keras_dist._keras_compat._orbax_private import without_preemption_queries
from keras_dist._keras_compat._saving import model_files, orbax_payload
from keras_dist.callbacks._background import BackgroundWriter
from keras_dist.callbacks._orbax import (
    background_barriers,
    collection_paused,
)

__all__ = ["ShardedCheckpoints", "restore_sharded"]

# `model.get_state_tree()`'s groups, in its order.
GROUPS = {
    "trainable_variables": lambda m: m.trainable_variables,
    "non_trainable_variables": lambda m: m.non_trainable_variables,
    "optimizer_variables": lambda m: m.optimizer.variables if m.optimizer else [],
    "metrics_variables": lambda m: m.metrics_variables,
}
# The checkpointable with each group's variable paths in the model's order.
ORDER = "keras_dist"


def _v1():
    import orbax.checkpoint as ocp

    return ocp.v1


class ShardedCheckpoints:
    """Numbered Orbax checkpoints of a model; one save in flight."""

    def __init__(
        self,
        directory: str,
        *,
        async_save: bool,
        max_to_keep: int | None,
        keep_period: int | None,
    ):
        ocp = _v1()
        policies = ocp.training.preservation_policies
        kept = [policies.LatestN(max_to_keep)] if max_to_keep else []
        if keep_period:
            kept.append(policies.EveryNSteps(keep_period))
        if not kept:
            preservation = policies.PreserveAll()
        elif len(kept) == 1:
            preservation = kept[0]
        else:
            preservation = policies.AnyPreservationPolicy(kept)
        self.directory = directory
        self._files: dict | None = None
        self.async_save = async_save
        if async_save:
            background_barriers()
        self._writer = BackgroundWriter(
            "ModelCheckpoint",
            f"The earlier checkpoints in {directory} are intact.",
            orbax=True,
        )
        self._checkpointer = ocp.training.Checkpointer(
            directory,
            preservation_policy=preservation,
            save_decision_policy=ocp.training.save_decision_policies.FixedIntervalPolicy(
                1
            ),
            cleanup_tmp_directories=True,
        )
        without_preemption_queries(self._checkpointer)

    def prepare(self, model) -> None:
        """Makes Keras's JSON and assets of `model` now (before `fit`'s first
        step, it waits for nothing); a model Keras cannot serialize fails at
        the first save instead, as with Keras's `OrbaxCheckpoint`."""
        try:
            self._files = model_files(model)
        except Exception:  # Raised again by the first save.
            self._files = None

    def steps(self) -> list[int]:
        return sorted(c.step for c in self._checkpointer.checkpoints)

    def save(self, model, step: int, *, weights_only: bool) -> str | None:
        """Saves `model` as `step` (asynchronously: starts); its directory.

        None if that step is saved already (an epoch end right after a save).
        """
        # Keras's model JSON and assets are made once a `fit` (this object's
        # life), by `prepare` before the first step where it can: making
        # them waits for every step dispatched. The optimizer's variables,
        # the learning rate's among them, are in the state of every save.
        if self._files is None and not weights_only:
            self._files = model_files(model)
        payload = orbax_payload(model, weights_only=weights_only, files=self._files)
        payload[ORDER] = {
            "paths": json.dumps(
                {group: [v.path for v in get(model)] for group, get in GROUPS.items()}
            )
        }
        self.wait()
        if step in self.steps():
            return None
        path = os.path.join(self.directory, str(step))
        if not self.async_save:
            self._write(step, payload)
            return path
        leaves, tree = jax.tree.flatten(payload["pytree"])
        payload["pytree"] = jax.tree.unflatten(tree, freeze(leaves))
        self._writer.submit(path, lambda: self._write(step, payload))
        return path

    def _write(self, step: int, payload: dict) -> None:
        context = _v1().Context()
        # Uncompressed, as Keras's `.weights.h5`: zstd saves ~9% of a float
        # state's bytes and more than doubles a write's CPU time.
        context.array.saving.use_compression = False
        with context, collection_paused():
            self._checkpointer.save_checkpointables(step, payload)

    def check(self) -> None:
        """Raises the error of a save that failed; never waits."""
        self._writer.check()

    def wait(self) -> None:
        self._writer.wait()

    def close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._checkpointer.close()


def _step_directory(path: str) -> str:
    steps = [int(e.name) for e in os.scandir(path) if e.name.isdigit() and e.is_dir()]
    return os.path.join(path, str(max(steps))) if steps else path


def _leaf(tree, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _put(tree: dict, path: str, value) -> None:
    *parents, name = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[name] = value


def restore_sharded(model, path: str) -> None:
    """Loads an Orbax checkpoint (a directory of steps: the newest) into `model`.

    Variables are matched by their order in the model, as the checkpoint's
    `keras_dist` record lists them (`ModelCheckpoint(sharded=True)`), so the
    model's and layers' names may differ from the saving run's; a checkpoint
    of Keras's `OrbaxCheckpoint` (no record) is matched by names, as Keras
    does. Each value is read in the layout of the variable it goes to
    (another mesh, number of processes or one device). An optimizer not
    built yet is built first; metrics not built yet (no `fit` or `evaluate`
    so far) are left as they are.

    Raises:
        ValueError: the checkpoint does not fit the model (naming the first
            variable that differs).
    """
    import orbax.checkpoint as ocp_root

    ocp = ocp_root.v1
    step_dir = _step_directory(path)
    order = None
    if os.path.isdir(os.path.join(step_dir, ORDER)):
        order = json.loads(
            ocp.load_checkpointables(step_dir, {ORDER: None})[ORDER]["paths"]
        )
    saved = ocp.pytree_metadata(step_dir, checkpointable_name="pytree").metadata
    abstract: dict = {}
    targets = []
    optimizer = getattr(model, "optimizer", None)
    if "optimizer_variables" in saved and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    for group, leaves in saved.items():
        abstract[group] = {}  # Orbax reads whole trees: every group, every leaf.
        variables = list(GROUPS[group](model))
        names = order[group] if order else [v.path for v in variables]
        if group == "metrics_variables" and len(names) != len(variables):
            # Metrics not built yet here: their epoch sums are read, not kept.
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
        if len(names) != len(variables):
            raise ValueError(
                f"The checkpoint {step_dir} does not fit this model: it has "
                f"{len(names)} {group}, the model {len(variables)}. Load it into "
                "the model that wrote it."
            )
        for variable, name in zip(variables, names, strict=True):
            try:
                meta = _leaf(leaves, name)
            except (KeyError, TypeError):
                raise ValueError(
                    f"The checkpoint {step_dir} has no {group} {name!r} (this "
                    f"model's {variable.path!r}). Keras's OrbaxCheckpoint matches "
                    "variables by name: build the model as the saving script did."
                ) from None
            if tuple(meta.shape) != tuple(variable.shape):
                raise ValueError(
                    f"The checkpoint {step_dir} does not fit this model: "
                    f"{variable.path!r} has shape {tuple(variable.shape)}, the "
                    f"checkpoint's {name!r} {tuple(meta.shape)}."
                )
            key = f"{group}/{name}"
            _put(
                abstract,
                key,
                jax.ShapeDtypeStruct(
                    meta.shape, meta.dtype, sharding=variable.value.sharding
                ),
            )
            targets.append((variable, key))
    loaded = ocp.load_checkpointables(step_dir, {"pytree": abstract})["pytree"]
    for variable, key in targets:
        variable.assign(_leaf(loaded, key))
