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
    """A requested device is not visible to this process.

    Example:

    ```python
    try:
        strategy = kd.MirroredStrategy(["gpu:0", "gpu:7"])
    except kd.errors.DeviceNotFoundError as error:  # also a ValueError
        print(error)  # lists the visible devices
    ```
    """


class TPUNotFoundError(DeviceNotFoundError):
    """No TPU is visible to JAX (tf's `TPUClusterResolver` raises `ValueError`
    here too, so `except ValueError:` fallbacks keep working).

    Example:

    ```python
    try:
        strategy = kd.TPUStrategy(kd.cluster.TPUClusterResolver())
    except ValueError:  # kd.errors.TPUNotFoundError without a TPU
        strategy = kd.MirroredStrategy()
    ```
    """


class StrategyMismatchError(RuntimeError):
    """Two strategies, or a strategy and a model's variables, disagree.

    Example:

    ```python
    with kd.MirroredStrategy().scope():
        try:
            with kd.OneDeviceStrategy("cpu:0").scope():  # two strategies at once
                pass
        except kd.errors.StrategyMismatchError as error:  # also a RuntimeError
            print(error)  # leave the other scope first
    ```
    """


class ProcessMismatchError(StrategyMismatchError, ValueError):
    """The processes of a cluster disagree: they build different variables,
    call `fit`/`evaluate`/`predict` differently, read different batches, or
    describe the cluster differently (`except ValueError` and `except
    StrategyMismatchError` both catch it).

    Example:

    ```python
    try:
        model.fit(x, y, batch_size=64)  # another batch_size on process 1
    except kd.errors.ProcessMismatchError as error:
        print(error)  # every process's value
    ```
    """


class ClusterConfigError(ValueError):
    """A cluster description (TF_CONFIG, SLURM, arguments) is wrong.

    Example:

    ```python
    try:
        kd.cluster.TFConfigClusterResolver(tf_config='{"cluster": {}}')
    except kd.errors.ClusterConfigError as error:
        print(error)  # quotes the offending part of TF_CONFIG
    ```
    """


class ClusterTimeoutError(TimeoutError):
    """A peer or the coordinator did not answer within the timeout.

    Example:

    ```python
    try:
        kd.cluster.initialize(timeout=30)
    except kd.errors.ClusterTimeoutError as error:
        print(error)  # names the coordinator address and the missing process
    ```
    """


class IncompatibleBackupError(ValueError):
    """A backup cannot be resumed: another model wrote it, or the input of the
    resumed `fit` cannot be replayed up to it.

    Example:

    ```python
    try:
        model.fit(x, y, callbacks=[kd.callbacks.BackupAndRestore("backup")])
    except kd.errors.IncompatibleBackupError as error:
        print(error)  # the first variable whose shape differs, or the input
    ```
    """


class CheckpointWriteError(OSError):
    """A checkpoint write failed (in the background, or on the training thread
    with `async_save=False`); the message names its path and the cause, and
    the previous checkpoint is intact.

    Example:

    ```python
    try:
        model.fit(x, y, callbacks=[kd.callbacks.BackupAndRestore("/full/disk")])
    except kd.errors.CheckpointWriteError as error:
        print(error)  # the backup's path and the cause; the previous one is intact
    ```
    """
