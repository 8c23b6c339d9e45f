"""The cluster layer: who am I, and joining the JAX multi-controller runtime."""

from keras_dist.cluster._environment import SlurmClusterResolver, resolve
from keras_dist.cluster._initialize import (
    RESTART_EXIT_CODE,
    initialize,
    is_initialized,
)
from keras_dist.cluster._resolver import ClusterResolver, SimpleClusterResolver
from keras_dist.cluster._tf_config import TFConfigClusterResolver
from keras_dist.cluster._tpu_resolver import TPUClusterResolver

__all__ = [
    "RESTART_EXIT_CODE",
    "ClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "initialize",
    "is_initialized",
    "resolve",
]
