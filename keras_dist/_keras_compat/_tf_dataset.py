"""Seam: a tf.data dataset passed to `fit/evaluate/predict` is split per process.

Keras 3.15 asked the distribution for the dataset each process reads
(`DataParallel.distribute_dataset`); Keras 3.16 dropped that hook and shards
inside its adapters, only with `auto_shard_dataset=True` (which keras_dist
keeps off: Keras's sharding needs a global batch divisible by the processes
and loses the exact partial batch). So the one place that works on both is
Keras's tf.data adapter itself: after `TFDatasetAdapter.__init__`, under a
keras_dist strategy, the adapter reads this process's share
(`data/_auto_shard.per_process_share`: the whole dataset under AUTO/DATA).
"""

from collections.abc import Callable
from typing import Any

from keras_dist.data._auto_shard import per_process_share
from keras_dist.strategies._base import Strategy

__all__ = ["tf_dataset_adapter_init"]


def tf_dataset_adapter_init(original: Callable) -> Callable:
    """Wraps `TFDatasetAdapter.__init__(self, dataset, class_weight, distribution)`."""

    def __init__(
        self,
        dataset,
        class_weight=None,
        distribution: Any = None,
    ):
        original(self, dataset, class_weight=class_weight, distribution=distribution)
        if isinstance(distribution, Strategy):
            self._dataset = per_process_share(distribution.placement, self._dataset)

    __init__._keras_dist_wrapped = original
    return __init__


def adapter_dataset(adapter: Any) -> Any:
    """The dataset a Keras data adapter reads (tf.data adapters), or None."""
    return getattr(adapter, "_dataset", None)
