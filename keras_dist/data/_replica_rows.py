"""`ReplicaRows`: which replica each real row of a step's batch came from.

The compiled step cuts a padded batch back to its real rows before the model
sees it (`_partial_batch`), so inside the step a layer sees only rows, not the
replicas they were laid out on. Layers whose numbers depend on the replica
(BatchNormalization with per-replica statistics, as tf's MirroredStrategy)
ask here: while a step of a keras_dist strategy runs (compiled: while it is
traced), `current()` describes its batch — the replica count, the padded
global size and the real rows — so row `i` of the real rows belonged to
replica `replica_ids()[i]`. The state is declared and owned here, set by the
one step wrapper (`training/_step.py`) for exactly the duration of one step
call; nothing is written on a strategy or a model.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from keras_dist.data._partial_batch import (
    NumReal,
    PaddedBatch,
    batch_size_of,
    segments_of,
    total_real,
)

__all__ = ["ReplicaRows", "current", "layout_of", "replica_rows"]


@dataclasses.dataclass(frozen=True)
class ReplicaRows:
    """The layout of one step's global batch over the replicas.

    Attributes:
        replicas: replicas the batch was split over (`num_replicas_in_sync`).
        padded_rows: rows of the global batch as laid out (a multiple of
            `replicas`); replica `r` held rows `r * b ... (r + 1) * b - 1`,
            `b = padded_rows // replicas`.
        num_real: the real rows (`_partial_batch.NumReal`), None if unpadded.
    """

    replicas: int
    padded_rows: int
    num_real: NumReal | None = None

    @property
    def per_replica(self) -> int:
        """Rows each replica held, padding included (`b`)."""
        return self.padded_rows // self.replicas

    @property
    def real_rows(self) -> int:
        """Rows the step's model sees (the real rows)."""
        if self.num_real is None:
            return self.padded_rows
        return total_real(self.num_real)

    def replica_ids(self) -> np.ndarray:
        """The replica of each real row, in the order the model sees them."""
        if self.num_real is None:
            rows = np.arange(self.padded_rows)
        else:
            rows = np.concatenate(
                [np.arange(s, s + c) for s, c in segments_of(self.num_real)]
            )
        return rows // self.per_replica


_CURRENT: contextvars.ContextVar["ReplicaRows | None"] = contextvars.ContextVar(
    "keras_dist_replica_rows", default=None
)


def current() -> ReplicaRows | None:
    """The layout of the batch of the step running now, or None outside one."""
    return _CURRENT.get()


@contextlib.contextmanager
def replica_rows(layout: ReplicaRows | None) -> Iterator[None]:
    """Within: `current()` is `layout` (the step seams' one step call)."""
    token = _CURRENT.set(layout)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def layout_of(args: tuple, replicas: int) -> ReplicaRows | None:
    """The layout of the batch among a step's arguments `(state, data)`."""
    padded = [a for a in args if isinstance(a, PaddedBatch)]
    data: Any = tuple(padded[0]) if padded else (args[-1] if args else None)
    try:
        size = batch_size_of(data)
    except ValueError:  # Not a batch Keras could train on; Keras says why.
        return None
    if not size or size % replicas:
        return None
    return ReplicaRows(replicas, size, padded[0].num_real if padded else None)
