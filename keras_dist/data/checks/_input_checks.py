"""Refuses rows where the replica API expects batches, at the call if it can.

`experimental_distribute_dataset` takes a dataset of *global* batches and
`distribute_datasets_from_function`'s `dataset_fn` returns one of
*per-replica* batches. Anything iterable is accepted, so without these checks
rows pass for batches silently: each row of a NumPy array, each example of a
list, each element of an unbatched `tf.data` dataset becomes a "batch".

The rules (`check_dataset` at the call, `first_element_checked` at the start
of each pass over an iterator or other iterable):

1. An array (NumPy, JAX, `tf.Tensor`, anything with `__array__` and `shape`)
   is rows, a mapping (a dict of arrays) iterates over its keys: refused.
2. An element is a batch when every leaf is an array of rank >= 1 and all
   leaves share the leading (batch) dimension. An element with a scalar leaf
   (a label, a Python number) or with leaves that disagree on the leading
   dimension (features (3,) and a one-hot (10,)) is one example. A list or
   tuple is checked at the call (its element 0), other iterables at the
   first element of each pass. A tuple whose elements differ in structure,
   rank or dtype is Keras's `(x, y)`, not batches: refused at the call (a
   list that changes mid-way is refused at that batch, by `BatchSignature`).
   A list of equally shaped arrays of rank >= 1 cannot be told from a list
   of batches and is accepted.
3. A `tf.data` dataset is refused when it is *provably* unbatched: followed
   back through its inputs it reaches `from_tensor_slices` or `unbatch`
   (whose elements are rows) through element-wise transformations only
   (`map` that adds no dimension, `filter`, `shuffle`, `repeat`, `prefetch`,
   `cache`, `take`, `skip`, `shard`, `with_options`, ...; `zip` and
   `concatenate` of such datasets) with no batching (`batch`,
   `padded_batch`, `ragged_batch`, `rebatch`, ...). tf.data keeps no
   "batched" flag and a `drop_remainder=True` batch has a static leading
   dimension like a row, so the graph is the only witness. Any other source
   or transformation (`from_generator`, `from_tensors`, file readers and
   TFDS, `interleave`, `flat_map`, `group_by_window`, a `map` that adds a
   dimension) may build batches itself: those datasets keep only the
   element-spec check that no component is a scalar
   (`_distributed_dataset._check_batched`). Slices of an already batched
   array (shape `(steps, batch, ...)`) look like rows: `rebatch` says so.
"""

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from keras_dist.data._tf_data import check_tf_dataset, is_tf_dataset

__all__ = ["check_dataset", "first_element_checked"]


_GLOBAL_FIX = (
    "Batch the examples by the global batch size first, e.g. "
    "`strategy.experimental_distribute_dataset(tf.data.Dataset"
    ".from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE))`."
)
_PER_REPLICA_FIX = (
    "Return a dataset batched by the per-replica batch size from `dataset_fn`, "
    "e.g. `return tf.data.Dataset.from_tensor_slices((x, y)).batch("
    "input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE))`."
)


def _fix(per_replica: bool) -> str:
    return _PER_REPLICA_FIX if per_replica else _GLOBAL_FIX


def _kind_of_batches(per_replica: bool) -> str:
    return "per-replica batches" if per_replica else "global batches"


# Describing values in messages ----------------------------------------------


class _Text(str):
    """A string that `repr`s without quotes: leaves of a described pytree."""

    def __repr__(self) -> str:
        return str(self)


def _shape(leaf: Any) -> tuple | None:
    """The leaf's shape (Python scalars and strings: `()`), None if unknown."""
    shape = getattr(leaf, "shape", None)
    if shape is None:
        return (
            tuple(np.shape(leaf))
            if isinstance(leaf, (int, float, complex, str, bytes, bool))
            else None
        )
    try:
        return tuple(shape)
    except (TypeError, ValueError):  # A tf.TensorShape of unknown rank.
        return None


def _describe_leaf(leaf: Any) -> _Text:
    dtype = getattr(leaf, "dtype", None)
    shape = _shape(leaf)
    if dtype is None or shape is None:
        text = repr(leaf)
        text = text if len(text) <= 20 else text[:17] + "..."
        return _Text(f"{type(leaf).__name__} {text}")
    dtype = getattr(dtype, "name", dtype)
    return _Text(f"{dtype}[{','.join(str(d) for d in shape)}]")


def _describe(value: Any, limit: int = 160) -> str:
    text = repr(jax.tree.map(_describe_leaf, value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_array(value: Any) -> str:
    shape = tuple(getattr(value, "shape", ()))
    dtype = getattr(value, "dtype", None)
    dtype = getattr(dtype, "name", dtype)
    return f"{type(value).__name__} of shape {shape} and dtype {dtype}"


# The checks ------------------------------------------------------------------


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and hasattr(value, "shape")


def _not_a_batch(element: Any) -> str | None:
    """Why `element` is one example rather than a batch, or None if it can be."""
    leaves = jax.tree.leaves(element)
    sizes: dict[int, Any] = {}
    for leaf in leaves:
        shape = _shape(leaf)
        if shape is None:
            continue
        if not shape:
            return (
                f"it has a scalar component ({_describe_leaf(leaf)}), so it is "
                "one example, not a batch"
            )
        if shape[0] is not None:
            sizes.setdefault(int(shape[0]), leaf)
    if len(sizes) > 1:
        found = " vs ".join(str(size) for size in sizes)
        return (
            f"its arrays disagree on the leading (batch) dimension ({found}), "
            "so it is one example, not a batch"
        )
    return None


def _signature(element: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(element)
    described = []
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", type(leaf))
        described.append((np.ndim(leaf), str(getattr(dtype, "name", dtype))))
    return treedef, tuple(described)


def _check_sequence(value, argument: str, per_replica: bool) -> None:
    received = f"{argument}={type(value).__name__} of {len(value)} elements"
    if not value:
        return
    first = value[0]
    reason = _not_a_batch(first)
    if reason is not None:
        raise ValueError(
            f"The elements of `{argument}` must be {_kind_of_batches(per_replica)} "
            f"(arrays with a leading batch dimension), but element 0 is not: "
            f"{reason}. Received: {received}, element 0={_describe(first)}. "
            f"{_fix(per_replica)}"
        )
    if not isinstance(value, tuple):
        return
    expected = _signature(first)
    for index, element in enumerate(value[1:], start=1):
        if _signature(element) != expected:
            raise ValueError(
                f"The elements of `{argument}` must be "
                f"{_kind_of_batches(per_replica)} of one structure, rank and dtype, "
                f"but element {index} differs from element 0. Received: "
                f"{received}, element 0={_describe(first)}, element {index}="
                f"{_describe(element)}. If these are whole arrays (e.g. `(x, y)` "
                "as given to `model.fit`), make batches of their rows. "
                f"{_fix(per_replica)}"
            )


def check_dataset(value: Any, *, argument: str, per_replica: bool) -> None:
    """Refuses, at the call, a `value` that is rows rather than batches.

    Args:
        value: what `experimental_distribute_dataset` was given, or what
            `dataset_fn` returned.
        argument: its name in messages (`"dataset"`,
            `"dataset_fn(input_context)"`).
        per_replica: whether batches are per-replica (`dataset_fn`) or global.

    Raises:
        TypeError: for an array or a mapping (not an iterable of batches).
        ValueError: for a list or tuple of examples, or a `tf.data` dataset
            that is provably unbatched.
    """
    if is_tf_dataset(value):
        check_tf_dataset(value, argument, per_replica)
        return
    if _is_array(value):
        raise TypeError(
            f"`{argument}` must be a dataset of {_kind_of_batches(per_replica)}, "
            "not an array: iterating an array yields its rows, so each row would "
            f"be a batch. Received: {argument}={_describe_array(value)}. "
            f"{_fix(per_replica).replace('(x, y)', 'x')}"
        )
    if isinstance(value, Mapping):
        raise TypeError(
            f"`{argument}` must be a dataset of {_kind_of_batches(per_replica)}, "
            "not a mapping: iterating a dict yields its keys. Received: "
            f"{argument}={type(value).__name__} {_describe(value)}. "
            f"{_fix(per_replica).replace('(x, y)', 'features_dict')}"
        )
    if isinstance(value, (list, tuple)):
        _check_sequence(value, argument, per_replica)


def first_element_checked(
    start_pass: Callable[[], Iterator[Any]],
    value: Any,
    *,
    argument: str,
    per_replica: bool,
) -> Callable[[], Iterator[Any]]:
    """`start_pass`, checking the first element of each pass if not done at the call.

    For iterators and iterables other than lists, tuples and `tf.data`
    datasets, whose elements cannot be seen without reading them. The
    attributes of `start_pass` (e.g. that it is one-shot) are kept.
    """
    if is_tf_dataset(value) or isinstance(value, (list, tuple)):
        return start_pass

    @functools.wraps(start_pass)
    def checked() -> Iterator[Any]:
        return _checked_pass(start_pass(), argument, per_replica)

    return checked


def _checked_pass(batches: Iterator[Any], argument: str, per_replica: bool):
    first = True
    for element in batches:
        if first:
            first = False
            reason = _not_a_batch(element)
            if reason is not None:
                raise ValueError(
                    f"The elements of `{argument}` must be "
                    f"{_kind_of_batches(per_replica)} (arrays with a leading batch "
                    f"dimension), but its first element is not: {reason}. "
                    f"Received: first element of {argument}={_describe(element)}. "
                    f"{_fix(per_replica)}"
                )
        yield element
