"""tf.data without importing TensorFlow first: is it a dataset, is it batched.

tf.data keeps no "batched" flag, and a `drop_remainder=True` batch has a
static leading dimension just like a row, so `rows_or_batches` walks back
through the dataset's inputs (TF's own private structure; on any surprise it
answers "unknown" and the caller accepts the dataset).
"""

import re
from typing import Any

from keras_dist._private_api import _tf_private

__all__ = [
    "BATCHED",
    "ROWS",
    "UNKNOWN",
    "cardinality",
    "check_tf_dataset",
    "is_tf_dataset",
    "rows_or_batches",
    "scalar_component",
    "unbatched_reason",
]

_MAX_NODES = 256  # Walk no further into a dataset graph: "unknown".


def is_tf_dataset(value: Any) -> bool:
    """Whether `value` is a `tf.data.Dataset` (TensorFlow imported only if so)."""
    return type(value).__module__.startswith("tensorflow") and hasattr(
        value, "element_spec"
    )


def cardinality(dataset) -> int:
    """The number of elements of `dataset` (tf's -1 infinite, -2 unknown).

    A `tf.data.Dataset` has the method `cardinality()`; tf.distribute's
    distributed datasets have the number itself as the attribute
    `cardinality` (as Keras's `TFDatasetAdapter.num_batches` reads it).
    """
    value = dataset.cardinality
    return int(value() if callable(value) else value)


def scalar_component(dataset):
    """The first rank-0 component of `dataset`'s elements (unbatched), or None."""
    import tensorflow as tf

    for spec in tf.nest.flatten(dataset.element_spec):
        if getattr(spec, "shape", None) is not None and spec.shape.rank == 0:
            return spec
    return None


def unbatched_reason(dataset) -> str | None:
    """Why `dataset`'s elements cannot be batches, or None (they may be).

    A batch has no scalar component, and its components share their first
    dimension (the batch); a `from_tensor_slices` of arrays of batches is
    batches, so nothing else is told apart.
    """
    import tensorflow as tf

    scalar = scalar_component(dataset)
    if scalar is not None:
        return f"a component is a scalar ({scalar}), and a batch has a batch dimension"
    firsts = set()
    for spec in tf.nest.flatten(dataset.element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape[0] is None:
            return None
        firsts.add(int(shape[0]))
    if len(firsts) > 1:
        sizes = ", ".join(map(str, sorted(firsts)))
        return (
            f"its components' first dimensions differ ({sizes}), and the "
            "components of a batch share theirs (the batch)"
        )
    return None


def rows_or_batches(dataset) -> tuple[str, list[str]]:
    """`(ROWS | BATCHED | UNKNOWN, the steps from a row source to dataset)`."""
    try:
        return _walk(dataset, [_MAX_NODES])
    except Exception:  # A private attribute moved in another TF version.
        return UNKNOWN, []


ROWS, BATCHED, UNKNOWN = "rows", "batched", "unknown"

_BATCHING = frozenset(
    {
        "_BatchDataset",
        "_ParallelBatchDataset",
        "_PaddedBatchDataset",
        "_RebatchDataset",
        "_LegacyRebatchDataset",
        "_DenseToRaggedDataset",
        "_DenseToSparseBatchDataset",
        "_MapAndBatchDataset",
    }
)
_ROW_SOURCES = {
    "_TensorSliceDataset": "from_tensor_slices",
    "_SparseTensorSliceDataset": "from_sparse_tensor_slices",
    "_UnbatchDataset": "unbatch",
}
_MAPS = frozenset({"_MapDataset", "_ParallelMapDataset"})
_COMBINING = {"_ZipDataset": "zip", "_ConcatenateDataset": "concatenate"}
_NAMES = {"_OptionsDataset": "with_options", "CacheDataset": "cache"}


def _label(dataset) -> str:
    name = type(dataset).__name__
    if name in _NAMES:
        return _NAMES[name]
    name = name.strip("_").removesuffix("Dataset")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _max_rank(element_spec) -> int | None:
    import tensorflow as tf

    ranks = []
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            return None
        ranks.append(shape.rank)
    return max(ranks, default=0)


def _walk(dataset, budget: list[int]) -> tuple[str, list[str]]:
    """(kind, the transformations from a row source up to `dataset`)."""
    budget[0] -= 1
    if budget[0] < 0:
        return UNKNOWN, []
    name = type(dataset).__name__
    if name in _BATCHING:
        return BATCHED, []
    if name in _ROW_SOURCES:
        return ROWS, [_ROW_SOURCES[name]]
    kind, inputs = _tf_private.upstream(dataset)
    if kind == "adapter":
        return _walk(inputs[0], budget)
    if name in _COMBINING:
        walked = [_walk(d, budget) for d in inputs]
        kinds = {kind for kind, _ in walked}
        if len(kinds) != 1:
            return UNKNOWN, []
        chain = [step for _, steps in walked for step in steps]
        return kinds.pop(), [*chain, _COMBINING[name]]
    if kind == "unchanged":
        kind, chain = _walk(inputs[0], budget)
        return kind, [*chain, _label(dataset)]
    if name in _MAPS and inputs:
        source = inputs[0]
        kind, chain = _walk(source, budget)
        if kind != ROWS:
            return kind, []
        # A function of one row is a row unless it adds a dimension (e.g.
        # gathers a batch from a row of indices).
        before = _max_rank(source.element_spec)
        after = _max_rank(dataset.element_spec)
        if before is None or after is None or after > before:
            return UNKNOWN, []
        return ROWS, [*chain, "map"]
    return UNKNOWN, []


# The checks (experimental_distribute_dataset, dataset_fn) -----------------


def check_tf_dataset(dataset, argument: str, per_replica: bool) -> None:
    """Refuses a dataset that is provably unbatched (scalar components, or
    a row source with no batching step after it), naming `argument`."""
    _check_no_scalars(dataset, argument, per_replica)
    kind, chain = rows_or_batches(dataset)
    if kind != ROWS:
        return
    size = _size_expression(per_replica)
    pipeline = " -> ".join(f"`{step}`" for step in chain)
    raise ValueError(
        f"`{argument}` must be batched by the "
        f"{'per-replica' if per_replica else 'global'} batch size, but its "
        f"elements are single examples: it is {pipeline}, with no `batch`. "
        f"Received: {argument}={type(dataset).__name__} with element_spec="
        f"{dataset.element_spec}. Batch it: `dataset.batch({size})`. (If each "
        "element already is a batch, e.g. a slice of an array of shape "
        f"(steps, batch, ...), say so with `dataset.rebatch({size})`.)"
    )


def _check_no_scalars(dataset, argument: str, per_replica: bool) -> None:
    """Any dataset whose element has a scalar component is unbatched."""
    scalar = scalar_component(dataset)
    if scalar is not None:
        raise ValueError(
            f"`{argument}` must be batched, but its elements have scalar "
            f"components ({scalar}). Received: element_spec="
            f"{dataset.element_spec}. Batch it by the {_size(per_replica)}: "
            f"`dataset.batch({_size_expression(per_replica)})`."
        )


def _size(per_replica: bool) -> str:
    return "per-replica batch size" if per_replica else "global batch size"


def _size_expression(per_replica: bool) -> str:
    if per_replica:
        return "input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)"
    return "GLOBAL_BATCH_SIZE"
