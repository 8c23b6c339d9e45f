"""TPU system helpers, as `tf.tpu.experimental`: `initialize_tpu_system`, `Topology`."""

from keras_dist.tpu._system import Topology, initialize_tpu_system

__all__ = ["Topology", "initialize_tpu_system"]
