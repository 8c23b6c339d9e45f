"""Partial batches: pad on the host, cut back inside the compiled step.

A global batch whose size is not a multiple of the number of replicas cannot
be laid out over the mesh (every device needs a shard of the same size; this
is the `IndivisibleError` of keras#21167). keras_dist pads such a batch with
rows of zeros up to the next multiple and records how many rows are real. The
record travels with the batch as a `PaddedBatch`, a tuple whose extra field
is *static* for JAX (pytree aux data), so the compiled step knows the real
size at trace time and slices every input back to it before the model sees
the batch.

From there on the computation is, row for row, the single-device one: XLA's
SPMD partitioner masks the padding of the now unevenly sharded arrays in
every reduction. So the loss is the mean over the real rows, metrics count
real rows only, `predict` returns exactly the real rows, batch statistics
(BatchNormalization) see only real rows, and custom `train_step`s and any
loss reduction stay exact. No sample is dropped and none is counted twice.
"""

import functools
from typing import Any

import jax
import numpy as np
import optree

from keras_dist.data._sparse import (
    is_leaf,
    is_sparse,
    map_rows,
    pad_sparse,
    rows_of,
    take_sparse,
)

__all__ = [
    "PaddedBatch",
    "as_padded_batch",
    "batch_size_of",
    "pad_rows",
    "pad_to",
    "real_mask",
    "real_rows_in",
    "round_up",
    "segments_of",
    "take_real",
    "total_real",
    "unpad",
]


class PaddedBatch(tuple):
    """A batch tuple `(x, y, sample_weight)` padded to a multiple of replicas.

    It is a tuple, so Keras unpacks it like any batch; `num_real` says how
    many leading rows are real (or which row segments, `NumReal`). The count
    is part of the type: `PaddedBatch(items, num_real)` gives an instance of
    the subclass for that count, so anything that rebuilds a tuple from its
    items alone keeps it — Keras's `Tracker` (`type(batch)(items)`), its
    `tree` utilities, `copy`, users' own code. As a pytree the count is
    static (each subclass is its own node type) and the children are the
    items.
    """

    num_real: "NumReal"

    def __new__(cls, items, num_real: "NumReal | None" = None):
        if num_real is None:
            if cls is PaddedBatch:
                raise TypeError(
                    "A `PaddedBatch` needs its real row count. Received: "
                    "num_real=None. Use `PaddedBatch(items, num_real)`."
                )
            return super().__new__(cls, items)
        return super().__new__(_padded_type(_count(num_real)), items)

    def __repr__(self) -> str:
        return f"PaddedBatch({tuple(self)!r}, num_real={self.num_real})"

    def __reduce__(self):
        return PaddedBatch, (tuple(self), self.num_real)


def _count(num_real: "NumReal") -> "NumReal":
    if isinstance(num_real, tuple):
        return tuple((int(start), int(count)) for start, count in num_real)
    return int(num_real)


@functools.cache
def _padded_type(num_real: "NumReal") -> type:
    """The `PaddedBatch` subclass of one real-row count, registered as a pytree."""
    padded = type("PaddedBatch", (PaddedBatch,), {"num_real": num_real})
    padded.__module__ = __name__
    jax.tree_util.register_pytree_node(
        padded, lambda batch: (tuple(batch), None), lambda _, items: padded(items)
    )
    # Keras walks batches with optree in its own namespace (e.g. to build the
    # model symbolically from the first batch); keep the type and count there.
    optree.register_pytree_node(
        padded,
        lambda batch: (tuple(batch), None, None),
        lambda _, items: padded(items),
        namespace="keras",
    )
    return padded


def _is_array(leaf: Any) -> bool:
    return leaf is not None and getattr(leaf, "ndim", 0) > 0


def batch_size_of(data: Any) -> int | None:
    """The leading dimension shared by every array in `data`.

    Raises:
        ValueError: if two arrays disagree on the batch dimension.
    """
    leaves = jax.tree.leaves(data)
    if all(type(leaf) is np.ndarray for leaf in leaves):  # Dense: no sparse walk.
        leaves = [leaf for leaf in leaves if leaf.ndim]
        sizes = {leaf.shape[0] for leaf in leaves}
    else:
        leaves = [
            leaf
            for leaf in jax.tree.leaves(data, is_leaf=is_leaf)
            if is_sparse(leaf) or _is_array(leaf)
        ]
        sizes = {
            rows_of(leaf) if is_sparse(leaf) else int(leaf.shape[0]) for leaf in leaves
        }
    if len(sizes) > 1:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise ValueError(
            "Every array of a batch must have the same size in its first "
            f"(batch) dimension. Received arrays of shapes {shapes}."
        )
    return sizes.pop() if sizes else None


def round_up(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


def pad_to(leaf: Any, rows: int) -> Any:
    """`leaf` with zero rows appended up to `rows` rows (the one dense padding;
    sparse matrices: `_sparse.pad_sparse`)."""
    if not _is_array(leaf) or leaf.shape[0] == rows:
        return leaf
    leaf = np.asarray(leaf)
    filler = np.zeros((rows - leaf.shape[0], *leaf.shape[1:]), dtype=leaf.dtype)
    return np.concatenate([leaf, filler], axis=0)


def pad_rows(data: Any, multiple: int) -> tuple[Any, int | None]:
    """Pads every array of `data` with zero rows to a multiple of `multiple`.

    Returns the padded pytree (same structure) and the real row count, or
    `(data, None)` when no padding was needed.
    """
    size = batch_size_of(data)
    if size is None or size % multiple == 0:
        return data, None
    padded_size = round_up(size, multiple)
    padded = map_rows(
        lambda leaf: pad_to(leaf, padded_size),
        lambda leaf: pad_sparse(leaf, padded_size),
        data,
    )
    return padded, size


def as_padded_batch(data: Any, num_real: "NumReal | None") -> Any:
    """`data` as a `PaddedBatch` with `num_real`, or unchanged if None."""
    if num_real is None:
        return data
    items = tuple(data) if isinstance(data, (tuple, list)) else (data,)
    return PaddedBatch(items, num_real)


# `num_real` is an int when the real rows are the leading ones (one process,
# or a global batch every process reads), else a tuple of `(start, count)`
# row segments: the real rows of each process's block when each process
# brings its own rows (a per-process input pipeline).
NumReal = int | tuple[tuple[int, int], ...]


def segments_of(num_real: NumReal) -> tuple[tuple[int, int], ...]:
    """The real rows as `(start, count)` segments."""
    if isinstance(num_real, tuple):
        return num_real
    return ((0, int(num_real)),)


def total_real(num_real: NumReal) -> int:
    """How many rows are real in all."""
    return sum(count for _, count in segments_of(num_real))


def take_real(leaf, num_real: NumReal):
    """The real rows of `leaf` (axis 0), in order; traceable."""
    if not isinstance(num_real, tuple):
        return leaf[:num_real]
    parts = [leaf[start : start + count] for start, count in num_real if count]
    if len(parts) == 1:
        return parts[0]
    return jax.numpy.concatenate(parts, axis=0)


def real_mask(rows, num_real: NumReal):
    """Whether each global row index in `rows` is real; traceable."""
    mask = None
    for start, count in segments_of(num_real):
        inside = (rows >= start) & (rows < start + count)
        mask = inside if mask is None else mask | inside
    return mask


def real_rows_in(num_real: NumReal, start: int, stop: int) -> int:
    """How many of the global rows `start ... stop - 1` are real."""
    return sum(
        max(0, min(stop, s + c) - max(start, s)) for s, c in segments_of(num_real)
    )


def unpad(data: Any) -> Any:
    """Cuts a `PaddedBatch` back to its real rows (a plain tuple); else identity.

    Meant to run inside `jax.jit`, where `num_real` is static.
    """
    if not isinstance(data, PaddedBatch):
        return data
    n = data.num_real
    return tuple(
        map_rows(
            lambda leaf: take_real(leaf, n) if _is_array(leaf) else leaf,
            lambda leaf: take_sparse(leaf, n),
            tuple(data),
        )
    )
