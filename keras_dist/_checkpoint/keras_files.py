"""The engine of Keras's files (`.weights.h5`, `.keras`): snapshot, write, commit.

`snapshot` (on the training thread) is Keras's saving walk
(`_private_api/_keras_saving.record`) with every value frozen (`freeze.py`);
`write` (on any thread) replays it into Keras's own `H5IOStore` (h5py writes
the bytes) under a temporary name, fsynced and renamed (`atomic_write`): a
crash leaves the previous file.
"""

import contextlib
import datetime
import json
import os
import pathlib
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.freeze import freeze, prepare
from keras_dist._private_api._keras_saving import (
    Snapshot,
    record,
    reusable,
    write_snapshot,
)

__all__ = [
    "SUFFIXES",
    "Snapshot",
    "atomic_write",
    "atomic_write_json",
    "prepare_snapshot",
    "record",
    "remove_stale_temps",
    "reusable",
    "snapshot",
    "write",
    "write_snapshot",
]

# Snapshot --------------------------------------------------------------------


def snapshot(
    model,
    *,
    with_config: bool,
    recorded: Snapshot | None = None,
    copy_local: bool = True,
) -> Snapshot:
    """The state `model.save_weights` (or `model.save`) would write, frozen.

    `recorded`: a `reusable` record of this model, to skip Keras's walk.
    `copy_local=False`: only take part in the gathers (see `freeze`).
    """
    if recorded is None:
        recorded = record(model, with_config=with_config)
    keys = [(i, k) for i, (_, _, group) in enumerate(recorded.entries) for k in group]
    frozen = freeze([recorded.entries[i][2][k] for i, k in keys], copy_local=copy_local)
    entries: list[tuple[str, Any, dict[str, Any]]] = [
        (path, metadata, {}) for path, metadata, _ in recorded.entries
    ]
    for (i, k), value in zip(keys, frozen, strict=True):
        entries[i][2][k] = value
    metadata = recorded.metadata_json
    if metadata is not None:  # Saved now, not when the walk was recorded.
        metadata = json.dumps(
            json.loads(metadata)
            | {"date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S")}
        )
    return Snapshot(
        entries=entries,
        config_json=recorded.config_json,
        metadata_json=metadata,
        assets_dir=recorded.assets_dir,
        nbytes=sum(int(v.nbytes) for v in frozen),
        # A kept walk's assets serve its later snapshots too.
        owns_assets=not reusable(recorded),
    )


def prepare_snapshot(recorded: Snapshot) -> None:
    """Compiles the copies `snapshot(..., recorded=recorded)` dispatches."""
    prepare(recorded.values())


def write(snap: Snapshot, path: str) -> None:
    """Writes `snap` to `path` (atomically) and releases it."""
    try:
        atomic_write(path, lambda p: write_snapshot(snap, p))
    finally:
        snap.release()


# Atomic commit ---------------------------------------------------------------

# `atomic_write`'s temporary names: `.tmp-<12 hex digits>-<final name>`.
_TEMP = re.compile(r"^\.tmp-[0-9a-f]{12}-.+$")
# Temporary files older than this (before any write of this process) were
# left by an interrupted earlier run.
_STARTED = time.time()


def atomic_write(final_path: str, write: Callable[[str], object]) -> None:
    """Calls `write(tmp_path)`, fsyncs, then renames `tmp_path` to `final_path`.

    The temporary file sits in the same directory and ends with the same
    name (format checks on the suffix pass); a crash before the rename
    leaves the previous `final_path` untouched. On a bucket (`gs://`,
    `s3://`): written to a local temporary file, then uploaded as one object.
    """
    if storage.is_remote(final_path):
        storage.write_whole(final_path, write, storage.basename(final_path))
        return
    directory, name = os.path.split(os.path.abspath(final_path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}-{name}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def atomic_write_json(final_path: str, payload: Any) -> None:
    """`payload` as JSON at `final_path`, written as `atomic_write` writes."""
    text = json.dumps(payload, indent=1)
    atomic_write(final_path, lambda path: pathlib.Path(path).write_text(text))


def remove_stale_temps(directory: str) -> list[str]:
    """Removes `atomic_write`'s temporary files an interrupted run left (named
    as it names them, last modified before this process started)."""
    removed: list[str] = []
    if storage.is_remote(directory):  # Written there whole, never in parts.
        return removed
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if not (_TEMP.match(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime < _STARTED:
                    os.remove(entry.path)
                    removed.append(entry.path)
    return removed


# The files `ModelCheckpoint` writes (and `latest_checkpoint` finds).
SUFFIXES = (".weights.h5", ".keras", ".h5")
