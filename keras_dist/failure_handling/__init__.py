"""tf.distribute's failure handling for custom loops: save at an agreed step."""

from keras_dist.failure_handling._preemption_handler import (
    PreemptionCheckpointHandler,
)
from keras_dist.failure_handling._termination_config import TerminationConfig

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig"]
