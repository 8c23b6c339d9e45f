"""The private tf.data reads of the input layer, behind public names.

tf.data has no public API to walk a pipeline back to its source (is a
dataset batched?) nor for file-level sharding without `tf.distribute`
(listed in `_private.TF_PRIVATE_ATTRIBUTES` and `PRIVATE_IMPORTS`, checked
once TensorFlow is imported). Imports nothing of keras_dist (and TensorFlow
only when called): any layer may call these.
"""

from typing import Any

__all__ = ["compute_batch_size", "file_shard", "upstream"]


def upstream(dataset: Any) -> tuple[str, list[Any]]:
    """How `dataset` is made from others: `(kind, its input datasets)`.

    `kind` is `"adapter"` (a tf1 `DatasetV1Adapter` around one dataset),
    `"unchanged"` (a one-input transformation that keeps the element
    structure) or `"other"` (any other: a source has no inputs).
    """
    from tensorflow.python.data.ops import dataset_ops

    if type(dataset).__name__ == "DatasetV1Adapter":
        return "adapter", [dataset._dataset]
    if isinstance(dataset, dataset_ops.UnaryUnchangedStructureDataset):
        return "unchanged", [dataset._input_dataset]
    try:
        return "other", list(dataset._inputs())
    except Exception:  # A dataset that does not list its inputs: a source.
        return "other", []


def compute_batch_size(dataset: Any) -> int:
    """The batch size of a batched `dataset` (-1: unknown), read as
    tf.distribute reads it."""
    from tensorflow.python.data.experimental.ops import distribute

    return int(distribute.compute_batch_size(dataset).numpy())


def file_shard(dataset: Any, num_shards: int, index: int) -> Any:
    """`dataset` reading only shard `index` of its source files (tf.distribute's
    AutoShardPolicy.FILE)."""
    from tensorflow.python.data.experimental.ops import distribute

    return distribute._AutoShardDataset(dataset, num_shards, index)
