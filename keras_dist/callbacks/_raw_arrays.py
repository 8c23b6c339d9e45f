"""A backup's arrays as their parts' raw bytes: `write`, `read`, and an Orbax
`CheckpointHandler` around them (`handler`, `save_args`, `restore_args`).

The handler is `BackupStore`'s item for one-process backups. Orbax's
`CheckpointManager` still numbers the backups, writes each into a temporary
directory and commits it by a rename, keeps two and deletes half-written
ones; this handler only writes the item's files inside that directory:

    arrays.bin    every array's distinct parts (a replicated array's once),
                  their bytes one after another, C order
    index.json    per array: its shape, its dtype and each part's
                  [start, stop) per axis, offset and length in arrays.bin

Both files are flushed and fsynced before Orbax commits (the data file
written with direct I/O where the system has it: `write_file`). Writing costs about
1.4-1.8x the bytes' own write (`benchmarks/save_cost.py`, 96 MB: 64-82 ms of
CPU with Orbax's step management; Orbax's array format 152-293 ms), which the
training thread's loop shares the host with while a save runs in the
background. A restore reads the parts through a memory map onto any layout:
another mesh, another number of devices or processes (each process reads
the parts its devices need).

With several processes, backups stay Orbax's (each process writes its own
parts; `BackupStore`).
"""

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist.utils._array_io import distinct_parts, index_bounds, write_file

__all__ = ["handler", "read", "restore_args", "save_args", "write"]

_DATA, _INDEX = "arrays.bin", "index.json"
_FORMAT = "keras_dist.raw_arrays/1"


def write(path: str, tree: dict) -> None:
    """Writes `tree` (`{group: [jax.Array]}`) into the directory `path`."""
    index: dict[str, Any] = {"format": _FORMAT, "groups": {}}
    arrays = [a for group in tree.values() for a in group]
    parts = iter(distinct_parts(arrays))  # Every device -> host copy started.
    buffers, offset = [], 0
    for group, group_arrays in tree.items():
        entries = []
        for a in group_arrays:
            stored = []
            for bounds, data in next(parts):
                buffers.append(data)
                stored.append([[list(b) for b in bounds], offset, data.nbytes])
                offset += data.nbytes
            entries.append(
                {
                    "shape": list(a.shape),
                    "dtype": np.dtype(a.dtype).name,
                    "parts": stored,
                }
            )
        index["groups"][group] = entries
    write_file(os.path.join(path, _DATA), buffers)  # Few calls; on disk.
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())


def read(path: str, targets: dict) -> dict:
    """The arrays in the directory `path`, laid out as `targets` (`{group:
    [jax.ShapeDtypeStruct]}`, with shardings) say."""
    with open(os.path.join(path, _INDEX)) as f:
        index = json.load(f)
    if index.get("format") != _FORMAT:
        raise ValueError(
            f"{path} holds arrays in format {index.get('format')!r}; this "
            f"keras_dist reads {_FORMAT!r}."
        )
    data = np.memmap(os.path.join(path, _DATA), dtype=np.uint8, mode="r")
    restored = {}
    for group, group_targets in targets.items():
        entries = index["groups"][group]
        if len(entries) != len(group_targets):
            raise ValueError(
                f"{path}: {len(entries)} {group} arrays saved, "
                f"{len(group_targets)} asked for."
            )
        restored[group] = [
            _restore_one(data, entry, target, path)
            for entry, target in zip(entries, group_targets, strict=True)
        ]
    return restored


def _restore_one(data: np.memmap, entry: dict, target, path: str) -> jax.Array:
    shape, dtype = tuple(entry["shape"]), jnp.dtype(entry["dtype"])
    if shape != tuple(target.shape):
        raise ValueError(
            f"{path}: an array of shape {shape} saved, {tuple(target.shape)} asked for."
        )
    whole = None

    def stored(bounds) -> np.ndarray:
        begin, length = bounds[1], bounds[2]
        part_shape = tuple(stop - start for start, stop in bounds[0])
        return data[begin : begin + length].view(dtype).reshape(part_shape)

    by_bounds = {tuple(map(tuple, p[0])): p for p in entry["parts"]}

    def part(index: tuple | None) -> np.ndarray:
        nonlocal whole
        index = index if index is not None else (slice(None),) * len(shape)
        key = index_bounds(index, shape)
        if key in by_bounds:  # Stored as this device needs it.
            value = stored(by_bounds[key])
        else:  # Another layout: the whole array, assembled once.
            if whole is None:
                whole = np.empty(shape, dtype)
                for p in entry["parts"]:
                    whole[tuple(slice(a, b) for a, b in p[0])] = stored(p)
            value = whole[index]
        return np.array(value, dtype=target.dtype)  # A copy off the map.

    return jax.make_array_from_callback(shape, target.sharding, part)


@functools.cache
def _orbax_types() -> tuple:
    """Orbax's handler and its save and restore arguments (Orbax is imported
    when a store first needs them, not with keras_dist)."""
    import orbax.checkpoint as ocp

    class RawArraysHandler(ocp.CheckpointHandler):
        """`write` and `read` as an Orbax item (one process writes; any
        number reads)."""

        def save(self, directory, args) -> None:  # An epath.Path.
            write(os.fspath(directory), args.item)

        def restore(self, directory, args) -> dict:
            return read(os.fspath(directory), args.item)

    @ocp.args.register_with_handler(RawArraysHandler, for_save=True)
    @dataclasses.dataclass
    class RawArraysSave(ocp.args.CheckpointArgs):
        item: dict  # {group: [jax.Array]}

    @ocp.args.register_with_handler(RawArraysHandler, for_restore=True)
    @dataclasses.dataclass
    class RawArraysRestore(ocp.args.CheckpointArgs):
        item: dict  # {group: [jax.ShapeDtypeStruct]}, with target shardings

    return RawArraysHandler, RawArraysSave, RawArraysRestore


def handler():
    """An Orbax `CheckpointHandler` for `CheckpointManager`'s item_handlers."""
    return _orbax_types()[0]()


def save_args(tree: dict):
    """Orbax's save arguments of `tree` (`{group: [jax.Array]}`)."""
    return _orbax_types()[1](tree)


def restore_args(targets: dict):
    """Orbax's restore arguments: `{group: [jax.ShapeDtypeStruct]}`."""
    return _orbax_types()[2](targets)
