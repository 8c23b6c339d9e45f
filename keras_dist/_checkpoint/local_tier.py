"""The local tier of backups: each process's own parts, on node-local storage.

`BackupAndRestore(local_dir=..., local_save_freq=K)` writes, every K steps,
what each process holds of the training state to `local_dir/process_<p>`
(`/dev/shm` or a local disk: storage only that host sees), one Orbax
checkpoint step per save that this process alone writes and reads
(`OrbaxStore(process_local=True)`, no barrier): NumPy arrays, each part of
a variable it holds once (a replicated variable: its whole value), with a
record of the parts' bounds and the backup's meta.

Restoring is collective (`choose`): the processes exchange which steps
they hold, and take the newest step at least as new as the persistent
tier's newest backup that is

- on every process, each reading its own parts (held in the running
  layout, or whole); or
- on some process that holds every variable whole (replicated state:
  Mirrored, MultiWorkerMirrored; a model split only inside each process):
  the lowest such process reads it and broadcasts it to the others, which
  lost theirs (a replaced host);

and otherwise none: the persistent tier's backup is restored (state split
over processes, whose parts went with a host).
"""

import json
import logging
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_dist._checkpoint.orbax_store import GROUPS, ORDER, Saving, keep_policy
from keras_dist._version import __version__

__all__ = [
    "Choice",
    "Store",
    "choose",
    "load",
    "parts",
    "quiet",
    "record",
    "variables",
]

LOCAL_FORMAT = "keras_dist.local/1"
_REPORTED = 4  # The newest local steps each process reports when restoring.


class _SizeNotLogged(logging.Filter):
    """Orbax warns at every save with `primary_host=None` (each process its
    own storage, as here) that it does not log the global size."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Global object size logging disabled" not in record.getMessage()


_QUIET = _SizeNotLogged()


def quiet() -> None:
    """Drops that one warning (idempotent)."""
    logging.getLogger("absl").addFilter(_QUIET)


ALL = tuple(GROUPS)


def variables(model, groups: tuple = ALL) -> list:
    """The backed-up variables of `groups`, in `GROUPS`' order."""
    return [v for name, group in GROUPS.items() if name in groups for v in group(model)]


def _bounds(index, shape: tuple) -> list:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def parts(values: list) -> list:
    """The bounds of this process's parts of each of `values` (None: it
    holds the whole value), each part once."""
    bounds: list = []
    for value in values:
        held: list = []
        for index in value.sharding.addressable_devices_indices_map(
            value.shape
        ).values():
            b = _bounds(index, value.shape)
            if b not in held:
                held.append(b)
        whole = [[0, n] for n in value.shape]
        bounds.append(None if held == [whole] else held)
    return bounds


def record(model, bounds: list, meta: dict, groups: tuple = ALL) -> dict:
    """The JSON a local backup holds beside its arrays."""
    described = [
        {"path": v.path, "shape": list(v.shape), "parts": b}
        for v, b in zip(variables(model, groups), bounds, strict=True)
    ]
    return {
        "format": LOCAL_FORMAT,
        "written_by": f"keras_dist {__version__}",
        "variables": json.dumps(described),
        "meta": json.dumps(meta),
    }


def _whole(described: dict) -> bool:
    held = described["parts"]
    if held is None:
        return True
    size = sum(math.prod(stop - start for start, stop in b) for b in held)
    return size == math.prod(described["shape"])


def _fits(model, saved: dict, groups: tuple) -> tuple[bool, bool]:
    """(this process can rebuild its parts from it, it holds every value
    whole) for a saved record and the running model."""
    if saved.get("format") != LOCAL_FORMAT:
        return False, False
    described = json.loads(saved["variables"])
    targets = variables(model, groups)
    current = [v.value.sharding for v in targets]
    if len(described) != len(current) or any(
        list(v.shape) != d["shape"] for v, d in zip(targets, described, strict=True)
    ):
        return False, False
    whole = all(_whole(d) for d in described)
    own = all(
        d["parts"] is None
        or all(
            _bounds(index, tuple(d["shape"])) in d["parts"]
            for index in s.addressable_devices_indices_map(tuple(d["shape"])).values()
        )
        for d, s in zip(described, current, strict=True)
    )
    return own or whole, whole


class Choice:
    """What `choose` agreed: the local step to restore, and where from
    (`source`: the process that broadcasts it; None: every process its own)."""

    def __init__(self, step: int, source: "int | None"):
        self.step, self.source = step, source


def choose(
    model, store, persistent_newest: "int | None", groups: tuple = ALL
) -> "Choice | None":
    """The local backup to restore, agreed by every process (collective);
    None: the persistent tier's. `store`: this process's local `Store`."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:  # As a restore does.
        optimizer.build(model.trainable_variables)
    table = np.full((_REPORTED, 3), -1, np.int64)
    for row, step in enumerate(sorted(store.steps(), reverse=True)[:_REPORTED]):
        try:
            saved = _read(store, step)
        except Exception:  # A torn step: not reported.
            continue
        own, whole = _fits(model, saved, groups)
        table[row] = step, own, whole
    if jax.process_count() > 1:
        table = np.asarray(multihost_utils.process_allgather(table))
    else:
        table = table[None]
    floor = 0 if persistent_newest is None else persistent_newest
    steps = sorted({int(s) for s in table[:, :, 0].ravel() if s >= floor}, reverse=True)
    for step in steps:
        rows = [next((r for r in held if r[0] == step), None) for held in table]
        if all(r is not None and r[1] for r in rows):
            return Choice(step, None)
        sources = [p for p, r in enumerate(rows) if r is not None and r[2]]
        if sources:
            return Choice(step, sources[0])
    return None


def _alone():
    import orbax.checkpoint as ocp

    here = jax.process_index()
    return ocp.options.MultiprocessingOptions(
        primary_host=here, active_processes={here}
    )


def _handlers(multiprocessing) -> dict:
    """Orbax's handlers of a local step, as its emergency manager's local
    tier has them: each process writes (and reads) every part it holds."""
    import orbax.checkpoint as ocp

    array = ocp.type_handlers.ArrayHandler(
        primary_host=None, replica_id=None, use_replica_parallel=False
    )
    return {
        "state": ocp.PyTreeCheckpointHandler(
            use_ocdbt=True,
            use_zarr3=True,
            use_compression=False,
            multiprocessing_options=multiprocessing,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry(
                (jax.Array, array)
            ),
        ),
        ORDER: ocp.JsonCheckpointHandler(
            "data.json", multiprocessing_options=multiprocessing
        ),
    }


class Store:
    """This process's local steps in `directory`: Orbax's `CheckpointManager`
    with its emergency manager's local options (every process primary of
    its own directory, which it creates; the barriers every process's: they
    all save the same steps), the newest 2 kept."""

    def __init__(self, directory: str, *, owner: str):
        import orbax.checkpoint as ocp

        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        multiprocessing = ocp.options.MultiprocessingOptions(
            primary_host=None,
            active_processes=set(range(jax.process_count())),
            barrier_sync_key_prefix=f"{owner}_local",
        )
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                # The keep policy of every tier and of `ModelCheckpoint`.
                preservation_policy=keep_policy(2, None),
                create=False,
                cleanup_tmp_directories=True,
                multiprocessing_options=multiprocessing,
                enable_async_checkpointing=True,
                single_host_load_and_broadcast=False,
                enable_background_delete=False,
                save_root_metadata=False,
                enable_per_process_directory_creation=True,
            ),
            item_handlers=_handlers(multiprocessing),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save_async(self, step: int, tree: dict, described: dict) -> Saving:
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(tree), **{ORDER: ocp.args.JsonSave(described)}
        )
        self._manager.save(step, args=args, force=True)
        manager = self._manager

        def wait() -> None:
            manager.wait_until_finished()
            manager.check_for_errors()

        return Saving(manager.is_saving_in_progress, wait)

    def reload(self) -> None:
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()


def _read(store: Store, step: int, abstract: "dict | None" = None):
    """This process's `step`: its record, or with `abstract` its arrays.

    Read with Orbax's handlers, as its emergency manager reads a local
    tier: no barrier and no operation id drawn (the other processes may
    read other steps, or none, and their later saves must still agree on
    Orbax's operation ids with this one's).
    """
    import orbax.checkpoint as ocp
    from etils import epath  # Orbax's paths

    step_dir = epath.Path(store.directory) / str(step)
    handlers = _handlers(_alone())
    if abstract is None:
        return handlers[ORDER].restore(step_dir / ORDER)
    restore = ocp.checkpoint_utils.construct_restore_args(abstract)
    return handlers["state"].restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore),
    )


def _whole_value(value: jax.Array) -> np.ndarray:
    """`value` whole, from the parts this process holds (all of it)."""
    if value.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    whole = np.empty(value.shape, value.dtype)
    for shard in value.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
    return whole


def _placed(whole: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(whole.shape, sharding, lambda i: whole[i])


def load(model, store, choice: Choice, groups: tuple = ALL) -> dict:
    """Loads the chosen local backup into `model` (every process, together);
    returns its meta with `metrics_values`."""
    targets = variables(model, groups)
    abstract = {
        str(i): jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding)
        for i, v in enumerate(targets)
    }
    here = jax.process_index()
    if choice.source is None or here == choice.source:
        meta = json.loads(_read(store, choice.step)["meta"])
        loaded = _read(store, choice.step, abstract)
        values = [loaded[str(i)] for i in range(len(targets))]
    if choice.source is not None:  # Broadcast from the source, whole.
        if here == choice.source:
            whole = [_whole_value(v) for v in values]
            text = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        else:
            whole = [np.zeros(v.shape, v.dtype) for v in targets]
            text = np.zeros(0, np.uint8)
        is_source = here == choice.source
        length = int(
            multihost_utils.broadcast_one_to_all(
                np.int32(text.size), is_source=is_source
            )
        )
        padded = np.zeros(length, np.uint8)
        padded[: text.size] = text
        whole, padded = multihost_utils.broadcast_one_to_all(
            (whole, padded), is_source=is_source
        )
        meta = json.loads(bytes(np.asarray(padded, np.uint8)).decode())
        values = [
            _placed(np.asarray(w), v.value.sharding)
            for w, v in zip(whole, targets, strict=True)
        ]
    metrics = {id(v) for v in model.metrics_variables}
    meta["metrics_values"] = []
    for variable, value in zip(targets, values, strict=True):
        variable.assign(value)
        if id(variable) in metrics:
            meta["metrics_values"].append(np.asarray(value))
    return meta
