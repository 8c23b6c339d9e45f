"""`CheckpointWatch`: the checkpoints of a directory that were not seen yet."""

import dataclasses
import json
import os

from keras_dist.callbacks._checkpoint_lookup import STATE_FILE

__all__ = ["Checkpoint", "CheckpointWatch"]

SUFFIXES = (".weights.h5", ".keras")


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
                stat = os.stat(checkpoint.path)
            except FileNotFoundError:  # Deleted by `max_to_keep` meanwhile.
                continue
            key = (checkpoint.path, stat.st_size, stat.st_mtime_ns)
            if key not in self._seen:
                self._seen.add(key)
                found.append(checkpoint)
        return found

    def _index(self) -> dict:
        try:
            with open(os.path.join(self.directory, STATE_FILE)) as f:
                index = json.load(f)
        except (OSError, ValueError):  # Absent, or being replaced: none yet.
            return {}
        return index if isinstance(index, dict) else {}

    def _listed(self) -> list[Checkpoint]:
        index = self._index()
        names = index.get("all")
        if isinstance(names, list) and names:
            epochs = index.get("epochs") or {}
            return [
                Checkpoint(os.path.join(self.directory, name), epochs.get(name))
                for name in names
                if isinstance(name, str)
            ]
        if not os.path.isdir(self.directory):
            return []
        paths = [
            os.path.join(self.directory, name)
            for name in os.listdir(self.directory)
            if name.endswith(SUFFIXES) and not name.startswith(".tmp-")
        ]
        paths.sort(key=lambda p: (os.path.getmtime(p), p))
        return [Checkpoint(path, None) for path in paths]
