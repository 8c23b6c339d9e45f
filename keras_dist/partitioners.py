"""Variable partitioners, as `tf.distribute.experimental.partitioners`.

Pass one to `kd.ParameterServerStrategy(variable_partitioner=...)`.
"""

from keras_dist.strategies.state._partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
]
