"""The input layer: global batches, distributed datasets, input contexts."""

from keras_dist.data._distributed_dataset import DistributedDataset, DistributedIterator
from keras_dist.data._input_context import InputContext, InputOptions

__all__ = ["DistributedDataset", "DistributedIterator", "InputContext", "InputOptions"]
