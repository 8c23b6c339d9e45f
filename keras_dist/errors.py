"""Named exceptions of keras_dist.

Each one subclasses the builtin a caller would naturally catch, so
`except ValueError` keeps working; the subclass lets tests and tools tell
keras_dist's own diagnoses apart.
"""

__all__ = [
    "CheckpointWriteError",
    "ClusterConfigError",
    "ClusterTimeoutError",
    "DeviceNotFoundError",
    "IncompatibleBackupError",
    "ProcessMismatchError",
    "StrategyMismatchError",
    "TPUNotFoundError",
]


class DeviceNotFoundError(ValueError):
    """A requested device is not visible to this process."""


class TPUNotFoundError(DeviceNotFoundError):
    """No TPU is visible to JAX (tf's `TPUClusterResolver` raises `ValueError`
    here too, so `except ValueError:` fallbacks keep working)."""


class StrategyMismatchError(RuntimeError):
    """Two strategies, or a strategy and a model's variables, disagree."""


class ProcessMismatchError(StrategyMismatchError, ValueError):
    """The processes of a cluster disagree: they build different variables,
    call `fit`/`evaluate`/`predict` differently, read different batches, or
    describe the cluster differently (`except ValueError` and `except
    StrategyMismatchError` both catch it)."""


class ClusterConfigError(ValueError):
    """A cluster description (TF_CONFIG, SLURM, arguments) is wrong."""


class ClusterTimeoutError(TimeoutError):
    """A peer or the coordinator did not answer within the timeout."""


class IncompatibleBackupError(ValueError):
    """A backup cannot be resumed: another model wrote it, or the input of the
    resumed `fit` cannot be replayed up to it."""


class CheckpointWriteError(OSError):
    """A checkpoint written in the background failed; the message names its
    path and the cause, and the previous checkpoint is intact."""
