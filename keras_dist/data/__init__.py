"""The input layer: global batches, distributed datasets, input contexts."""

from keras_dist.data._input_context import InputContext, InputOptions
from keras_dist.data.host._auto_shard import AutoShardPolicy, with_auto_shard_policy
from keras_dist.data.host._distributed_dataset import (
    DistributedDataset,
    DistributedIterator,
)

__all__ = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "with_auto_shard_policy",
]
