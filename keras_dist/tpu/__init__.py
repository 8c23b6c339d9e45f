"""TPUs: `TPUStrategy`, its device order, and the system helpers of
`tf.tpu.experimental` (`initialize_tpu_system`, `Topology`). The resolver,
`TPUClusterResolver`, is with the other resolvers in `keras_dist.cluster`."""

from keras_dist.tpu._strategy import TPUStrategy
from keras_dist.tpu._system import Topology, initialize_tpu_system

__all__ = ["TPUStrategy", "Topology", "initialize_tpu_system"]
