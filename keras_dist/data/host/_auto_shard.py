"""`AutoShardPolicy`: how a tf.data dataset is split over processes.

Set it as in tf.distribute, on the dataset's options, or with the helper:

```python
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = (
    tf.data.experimental.AutoShardPolicy.FILE
)
dataset = dataset.with_options(options)
# or
dataset = kd.data.with_auto_shard_policy(dataset, kd.data.AutoShardPolicy.FILE)
```
"""

import enum
import weakref
from typing import Any

from keras_dist._private_api import _tf_private
from keras_dist.data._target import InputTarget
from keras_dist.data._tf_data import is_tf_dataset

__all__ = [
    "AutoShardPolicy",
    "auto_shard_policy",
    "is_per_process",
    "per_process_share",
    "shard_per_process",
    "with_auto_shard_policy",
]

_PER_PROCESS: "weakref.WeakSet" = weakref.WeakSet()


class AutoShardPolicy(enum.IntEnum):
    """How each process gets its share of a tf.data dataset (tf's values).

    - `AUTO` (default): like `DATA`. (tf.distribute tries `FILE` first; keras_dist
      keeps `AUTO` exact: training equals one process row for row.)
    - `DATA`: every process reads the whole dataset and keeps its rows of each
      global batch. Exact, same steps everywhere; each process reads all data.
    - `FILE`: each process reads only its files (tf's file-level sharding of
      the dataset's source files, e.g. `TFRecordDataset` over
      `list_files`); the global batch is split `batch/num_processes` per
      process. Needs at least as many files as processes.
    - `OFF`: no sharding: each process's dataset already is its own share
      (e.g. you called `dataset.shard` yourself); each process reads
      `batch/num_processes` rows of it per step.

    With `FILE` and `OFF`, processes may run out of data at different steps:
    keras_dist pads and masks, so every process runs the same steps.

    Example:

    ```python
    files = tf.data.Dataset.list_files("data/train-*.tfrecord", shuffle=False)
    dataset = tf.data.TFRecordDataset(files).map(parse).batch(64)
    dataset = kd.data.with_auto_shard_policy(dataset, kd.data.AutoShardPolicy.FILE)
    # also AutoShardPolicy.AUTO (the default), DATA and OFF
    ```
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


_POLICY_VALUES = frozenset(policy.value for policy in AutoShardPolicy)


def with_auto_shard_policy(dataset: Any, policy: "AutoShardPolicy | str") -> Any:
    """`dataset` with its auto-shard policy set (tf's dataset option).

    Example:

    ```python
    dataset = kd.data.with_auto_shard_policy(dataset, "OFF")  # already this process's
    model.fit(dataset, epochs=2)
    ```

    Args:
        dataset: a `tf.data.Dataset`.
        policy: a `kd.data.AutoShardPolicy`, tf's enum, or its name
            (`"FILE"`, `"DATA"`, `"OFF"`, `"AUTO"`).

    Raises:
        ValueError: for an unknown policy.
    """
    import tensorflow as tf

    if isinstance(policy, str) and policy.upper() in AutoShardPolicy.__members__:
        policy = AutoShardPolicy[policy.upper()]
    value = getattr(policy, "value", policy)
    if isinstance(value, bool) or value not in _POLICY_VALUES:
        raise ValueError(
            f"`policy` must be one of {[p.name for p in AutoShardPolicy]}. "
            f"Received: policy={policy!r}."
        )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy(int(value))
    )
    return dataset.with_options(options)


def auto_shard_policy(dataset: Any) -> AutoShardPolicy:
    """The policy set on a tf.data `dataset`'s options (AUTO if none)."""
    options = dataset.options()
    value = options.experimental_distribute.auto_shard_policy
    value = int(getattr(value, "value", value))
    if value not in _POLICY_VALUES:
        raise ValueError(
            f"keras_dist supports the auto-shard policies "
            f"{[p.name for p in AutoShardPolicy]}. Received: auto_shard_policy="
            f"{value!r} (HINT needs tf.distribute's sharding hints; use FILE or "
            "DATA)."
        )
    return AutoShardPolicy(value)


def shard_per_process(
    dataset: Any, policy: AutoShardPolicy, num_processes: int, index: int
) -> Any:
    """This process's share of `dataset`, batched `global_batch / num_processes`.

    Raises:
        ValueError: if the dataset's batch size is unknown or does not divide
            by the number of processes.
    """
    import tensorflow as tf

    global_batch = _tf_private.compute_batch_size(dataset)
    if global_batch <= 0 or global_batch % num_processes:
        raise ValueError(
            f"With AutoShardPolicy.{policy.name}, each of the {num_processes} "
            "processes reads `global_batch / num_processes` rows per step, so the "
            "dataset must be batched by a known global batch size divisible by "
            f"{num_processes}. Received: batch size {global_batch} (-1: unknown; "
            "batch with `drop_remainder=False` and a constant size)."
        )
    if policy == AutoShardPolicy.FILE:
        dataset = _tf_private.file_shard(dataset, num_processes, index)
    dataset = dataset.rebatch(global_batch // num_processes)
    # Processes may hold different numbers of batches: the step count comes
    # from the per-step agreement, not from a cardinality Keras would trust.
    return dataset.filter(lambda *_: True).prefetch(tf.data.AUTOTUNE)


def per_process_share(strategy: InputTarget, dataset: Any) -> Any:
    """`dataset` for a strategy: whole (AUTO/DATA), or this process's share."""
    if strategy.num_processes == 1 or not is_tf_dataset(dataset):
        return dataset
    policy = auto_shard_policy(dataset)
    if policy in (AutoShardPolicy.AUTO, AutoShardPolicy.DATA):
        return dataset
    share = shard_per_process(
        dataset, policy, strategy.num_processes, strategy.process_id
    )
    _PER_PROCESS.add(share)
    return share


def is_per_process(dataset: Any) -> bool:
    """Whether `dataset` is one process's share (its batches are per process)."""
    try:
        return dataset in _PER_PROCESS
    except TypeError:
        return False
