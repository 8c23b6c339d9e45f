"""Sparse batches: one leaf per matrix, zero rows padded, real rows cut back.

Keras's data adapters hand sparse inputs (`scipy.sparse` matrices,
`tf.SparseTensor`s in `tf.data`, `jax.experimental.sparse.BCOO`) to the JAX
trainer as `BCOO` matrices (`data_adapter_utils.get_jax_iterator`,
`TFDatasetAdapter.get_jax_iterator`, `ArrayDataAdapter` slicing). A `BCOO` is
a pytree whose children are its stored entries, `data` of shape `(nse, ...)`
and `indices` of shape `(nse, n_sparse)`: `nse` (the number of stored
entries) is not the batch size. Code that walks a batch with
`jax.tree.leaves` and reads `leaf.shape[0]` therefore sees arrays that
"disagree on the batch dimension", pads the wrong axis, and lays the entries
out as if they were rows. This module lets the input pipeline treat a sparse
matrix as one leaf of `shape[0]` rows:

- `is_leaf` for `jax.tree.*(..., is_leaf=is_leaf)`: a sparse matrix is a leaf;
- `rows_of`: its batch size (the dense `shape[0]`);
- `pad_sparse`: the same stored entries in a matrix with more rows. The new
  rows are implicitly zero, so the padding is exact and costs nothing;
- `take_sparse`: the real rows back, inside `jax.jit` (static row counts,
  `bcoo_slice` keeps `nse` static), also for `(start, count)` segments;
- `place_sparse`: the layout. A `BCOO`'s children cannot take the batch
  layout `P("batch", None)` (its `data` is rank 1, and its leading axis
  counts entries, not rows, and rarely splits over the devices), so the
  matrix is *replicated* over the mesh. The compiled step computes the same
  global result whatever the input layout; XLA inserts the collectives, and
  the numbers equal those of one device.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jax_sparse
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "is_leaf",
    "is_sparse",
    "map_rows",
    "pad_sparse",
    "place_sparse",
    "rows_of",
    "sparse_sharding",
    "take_sparse",
    "to_bcoo",
]

# `(start, count)` row segments, as `_partial_batch.NumReal`.
NumReal = int | tuple[tuple[int, int], ...]


def _is_scipy_sparse(value: Any) -> bool:
    # By module name, as Keras does: no scipy import for dense batches.
    return type(value).__module__.startswith("scipy.sparse") and hasattr(value, "tocoo")


def _is_tf_sparse(value: Any) -> bool:
    # By name, as Keras does: no TensorFlow import for dense batches.
    cls = type(value)
    return cls.__name__ == "SparseTensor" and "tensorflow" in cls.__module__


def is_sparse(leaf: Any) -> bool:
    """Whether `leaf` is a sparse matrix.

    Args:
        leaf: anything found in a batch.

    Returns:
        True for `jax.experimental.sparse` arrays (`BCOO`, what Keras's data
        adapters yield for the JAX backend), `scipy.sparse` matrices and
        `tf.SparseTensor`s (which reach a batch only when the user hands them
        over directly, e.g. to `train_on_batch`).
    """
    if isinstance(leaf, _DENSE):  # Most leaves of most batches: one test.
        return False
    return (
        isinstance(leaf, jax_sparse.JAXSparse)
        or _is_scipy_sparse(leaf)
        or _is_tf_sparse(leaf)
    )


# Arrays no sparse type derives from (a `BCOO` is not a `jax.Array`).
_DENSE = (np.ndarray, jax.Array)


def is_leaf(x: Any) -> bool:
    """`is_leaf` for `jax.tree` functions: a sparse matrix is one leaf.

    Example:
        `jax.tree.leaves(batch, is_leaf=is_leaf)` lists a `BCOO` as itself,
        not as its `data` and `indices` children.
    """
    return not isinstance(x, _DENSE) and is_sparse(x)


def to_bcoo(leaf: Any) -> jax_sparse.BCOO:
    """`leaf` as a `BCOO`, converted the way Keras's data adapters do.

    Args:
        leaf: a `BCOO`, `scipy.sparse` matrix or `tf.SparseTensor`.

    Returns:
        `leaf` itself if it is a `BCOO`, else its entries as a `BCOO`.

    Raises:
        TypeError: for other sparse formats (e.g. `BCSR`): their padding and
            cut are not implemented, and converting would change the type the
            model receives.
    """
    if isinstance(leaf, jax_sparse.BCOO):
        return leaf
    if _is_scipy_sparse(leaf):
        return jax_sparse.BCOO.from_scipy_sparse(leaf)
    if _is_tf_sparse(leaf):
        return jax_sparse.BCOO(
            (jnp.asarray(leaf.values), jnp.asarray(leaf.indices)),
            shape=tuple(int(d) for d in leaf.dense_shape),
        )
    raise TypeError(
        "keras_dist pads and lays out sparse batches as "
        "`jax.experimental.sparse.BCOO` (or scipy.sparse / tf.SparseTensor, "
        f"converted to BCOO). Received: {type(leaf).__name__}."
    )


def rows_of(leaf: Any) -> int:
    """The number of rows (dense `shape[0]`) of a sparse matrix.

    Args:
        leaf: a `BCOO`, `scipy.sparse` matrix or `tf.SparseTensor`.

    Returns:
        The batch size of `leaf`, not its number of stored entries.
    """
    if _is_tf_sparse(leaf):
        return int(leaf.dense_shape[0])
    return int(leaf.shape[0])


def pad_sparse(leaf: Any, rows: int) -> jax_sparse.BCOO:
    """`leaf` as a `BCOO` with all-zero rows appended up to `rows` rows.

    Exact: no stored entry changes value or position, so row for row the
    matrix is the input with zeros below. With `n_batch == 0` (what Keras
    builds) the stored entries are untouched; only the shape grows, and any
    out-of-bounds entries (the sentinels of sliced `BCOO`s, row index
    `shape[0]`) are moved to the new bound so they stay out of bounds. With
    `n_batch > 0` the children get zero entries for the new rows.

    Args:
        leaf: a sparse matrix (`BCOO`, scipy.sparse, tf.SparseTensor).
        rows: the padded row count, at least `rows_of(leaf)`.

    Returns:
        The padded `BCOO` (or `leaf` itself if it has `rows` rows already).

    Raises:
        ValueError: if `rows` is smaller than the row count of `leaf`.
    """
    matrix = to_bcoo(leaf)
    old = matrix.shape[0]
    if rows == old:
        return matrix
    if rows < old:
        raise ValueError(f"Cannot pad a sparse batch of {old} rows to {rows} rows.")
    shape = (rows, *matrix.shape[1:])
    data, indices = matrix.data, matrix.indices
    flags = {
        "indices_sorted": matrix.indices_sorted,
        "unique_indices": matrix.unique_indices,
    }
    if matrix.n_batch == 0:
        row = indices[:, 0]
        if isinstance(row, jax.core.Tracer) or bool(np.any(np.asarray(row) >= old)):
            indices = indices.at[:, 0].set(jax.numpy.where(row >= old, rows, row))
    else:
        extra = rows - old
        data = jax.numpy.concatenate(
            [data, jax.numpy.zeros((extra, *data.shape[1:]), data.dtype)], axis=0
        )
        indices = jax.numpy.concatenate(
            [indices, jax.numpy.zeros((extra, *indices.shape[1:]), indices.dtype)],
            axis=0,
        )
        # A new row's entries all sit at index 0 (value 0): not unique.
        flags = {"indices_sorted": False, "unique_indices": False}
    return jax_sparse.BCOO((data, indices), shape=shape, **flags)


def _rows(matrix: jax_sparse.BCOO, start: int, stop: int) -> jax_sparse.BCOO:
    return jax_sparse.bcoo_slice(
        matrix,
        start_indices=(start,) + (0,) * (matrix.ndim - 1),
        limit_indices=(stop, *matrix.shape[1:]),
    )


def take_sparse(leaf: jax_sparse.BCOO, num_real: NumReal) -> jax_sparse.BCOO:
    """The real rows of a padded `BCOO`, in order; traceable.

    Meant to run inside `jax.jit`, where `num_real` is static: the result
    has a static shape and keeps `nse` (entries of cut rows become
    out-of-bounds, zero-valued entries that every sparse op ignores).

    Args:
        leaf: a `BCOO` (e.g. from `pad_sparse`, possibly laid out over a mesh).
        num_real: the leading real row count, or a tuple of `(start, count)`
            row segments (as `_partial_batch.NumReal`).

    Returns:
        A `BCOO` of the real rows only; `leaf` itself when every row is real.
    """
    if not isinstance(num_real, tuple):
        num_real = int(num_real)
        if num_real == leaf.shape[0]:
            return leaf
        return _rows(leaf, 0, num_real)
    parts = [_rows(leaf, start, start + count) for start, count in num_real if count]
    if not parts:
        return _rows(leaf, 0, 0)
    if len(parts) == 1:
        return parts[0]
    return jax_sparse.bcoo_concatenate(parts, dimension=0)


def sparse_sharding(mesh: Mesh) -> NamedSharding:
    """The layout of a sparse batch on `mesh`: replicated on every device."""
    return NamedSharding(mesh, PartitionSpec())


def place_sparse(leaf: Any, mesh: Mesh) -> jax_sparse.BCOO:
    """A sparse batch laid out over `mesh`: each child replicated.

    `jax.device_put(bcoo, sharding)` applies the sharding to each child, so
    the batch layout `P("batch", None)` fails on the rank-1 `data`, and
    `P("batch")` would split stored entries (not rows) and fails when `nse`
    does not divide. Replicated, every device holds the whole matrix and
    the compiled step's result is exactly the one-device result.

    With a mesh that spans processes, every process must pass the whole
    global sparse batch (each child becomes a global array from it).

    Args:
        leaf: a sparse matrix (`BCOO`, scipy.sparse, tf.SparseTensor).
        mesh: the strategy's mesh.

    Returns:
        The `BCOO` with children replicated over `mesh`.
    """
    matrix = to_bcoo(leaf)
    sharding = sparse_sharding(mesh)
    if sharding.is_fully_addressable:
        return jax.device_put(matrix, sharding)
    return jax.tree.map(
        lambda child: jax.make_array_from_process_local_data(
            sharding, np.asarray(child), child.shape
        ),
        matrix,
    )


def map_rows(
    dense: Callable[[Any], Any], sparse: Callable[[Any], Any], tree: Any
) -> Any:
    """`tree` with `sparse` applied to sparse matrices, `dense` to other leaves.

    Args:
        dense: what to do with a leaf that is not sparse.
        sparse: what to do with a sparse matrix (one leaf, see `is_leaf`).
        tree: a batch (any pytree).

    Returns:
        The mapped pytree, same structure.
    """
    return jax.tree.map(
        lambda leaf: sparse(leaf) if is_sparse(leaf) else dense(leaf),
        tree,
        is_leaf=is_leaf,
    )
