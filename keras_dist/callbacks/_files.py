"""Atomic writes and early checks of output directories."""

import contextlib
import os
import re
import time
import uuid
from collections.abc import Callable

__all__ = ["atomic_write", "check_writable_dir", "remove_stale_temps"]

# `atomic_write`'s temporary names: `.tmp-<12 hex digits>-<final name>`.
_TEMP = re.compile(r"^\.tmp-[0-9a-f]{12}-.+$")
# Temporary files older than this (the import of this module, before any
# write of this process) were left by an interrupted earlier run.
_STARTED = time.time()


def check_writable_dir(path: str, *, argument: str) -> str:
    """Creates `path` if needed and proves it is writable, or raises now.

    Raises:
        PermissionError: if the directory cannot be created or written.
    """
    directory = os.path.abspath(path or ".")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".keras_dist-write-test-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"`{argument}` must be in a writable directory, checked before "
            f"training starts. Received: {argument}={path!r} ({error.strerror}: "
            f"{directory}). Pick a directory you can write to."
        ) from error
    return directory


def atomic_write(final_path: str, write: Callable[[str], object]) -> None:
    """Calls `write(tmp_path)` then renames `tmp_path` to `final_path`.

    The temporary file sits in the same directory and ends with the same
    name, so format checks on the suffix pass; a crash before the rename
    leaves the previous `final_path` untouched.
    """
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


def remove_stale_temps(directory: str) -> list[str]:
    """Removes `atomic_write` temporary files an interrupted run left behind.

    Only files named as `atomic_write` names them and last modified before
    this process started are removed (never another file, nor a write in
    progress in this process).

    Returns:
        The paths removed.
    """
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if not (_TEMP.match(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime < _STARTED:
                    os.remove(entry.path)
                    removed.append(entry.path)
    return removed
