"""Layers that know about replicas: BatchNormalization per replica or synchronized."""

from keras_dist.layers._batch_normalization import BatchNormalization
from keras_dist.layers._sync_batch_normalization import SyncBatchNormalization

__all__ = ["BatchNormalization", "SyncBatchNormalization"]
