"""`InputContext` and `InputOptions`, as in tf.distribute."""

import dataclasses

from keras_dist._checks import check_int

__all__ = ["InputContext", "InputOptions"]


class InputContext:
    """What an input function needs to know to build its part of the input.

    Passed to the `dataset_fn` of `strategy.distribute_datasets_from_function`,
    like `tf.distribute.InputContext`.

    Example:

    ```python
    def dataset_fn(ctx: kd.InputContext):
        batch = ctx.get_per_replica_batch_size(64)  # global batch 64
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        dataset = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return dataset.batch(batch)

    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    ```

    Args:
        num_input_pipelines: how many input pipelines (processes) feed the
            replicas. Defaults to 1.
        input_pipeline_id: this pipeline's index, `0 ... num_input_pipelines-1`.
            Defaults to 0.
        num_replicas_in_sync: replicas the global batch is split over.
            Defaults to 1.

    Raises:
        ValueError: if a count is not positive or the id is out of range.
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        check_int(num_input_pipelines, name="num_input_pipelines")
        check_int(num_replicas_in_sync, name="num_replicas_in_sync")
        if not isinstance(input_pipeline_id, int) or not (
            0 <= input_pipeline_id < num_input_pipelines
        ):
            raise ValueError(
                "`input_pipeline_id` must be in [0, num_input_pipelines="
                f"{num_input_pipelines}). Received: "
                f"input_pipeline_id={input_pipeline_id!r}."
            )
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch of each replica: `global_batch_size / num_replicas_in_sync`.

        Raises:
            ValueError: if `global_batch_size` is not a positive multiple of
                `num_replicas_in_sync`.
        """
        n = self._num_replicas_in_sync
        if isinstance(global_batch_size, bool) or not isinstance(
            global_batch_size, int
        ):
            raise TypeError(
                "`global_batch_size` must be an int. Received: "
                f"global_batch_size={global_batch_size!r}."
            )
        if global_batch_size <= 0 or global_batch_size % n:
            lower = max(n, global_batch_size // n * n)
            raise ValueError(
                "`global_batch_size` must be a positive multiple of the "
                f"{n} replicas. Received: global_batch_size={global_batch_size}. "
                f"Use e.g. {lower} or {lower + n}."
            )
        return global_batch_size // n

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
            f"input_pipeline_id={self.input_pipeline_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Input options, as `tf.distribute.InputOptions`.

    Passed to `experimental_distribute_dataset`, or set on a strategy
    (`strategy.input_options = kd.InputOptions(...)`) for the input of
    `fit`/`evaluate`/`predict`.

    Example:

    ```python
    strategy = kd.MirroredStrategy()
    # In-memory arrays always from the host, each step; no fused groups.
    strategy.input_options = kd.InputOptions(device_resident=False, fuse_steps=False)
    dist = strategy.experimental_distribute_dataset(
        dataset, kd.InputOptions(experimental_per_replica_buffer_size=2)
    )
    ```

    Args:
        experimental_fetch_to_device: copy batches to the devices ahead of
            time on a background thread. Defaults to `True`.
        experimental_per_replica_buffer_size: how many batches to keep ready
            ahead of the step (>= 1). Defaults to 1.
        device_resident: for in-memory arrays (NumPy, `jax.Array`) given to
            `fit`/`evaluate`/`predict`: lay the dataset out on the devices
            once, and take each step's batch there, in the order Keras's
            shuffle gives (same numbers). Data read only in its own order
            (`shuffle=False`, `evaluate`, `predict`, validation data) is
            split over the replicas as blocks of batches, each device
            holding its rows of every batch (1/replicas of the data), and
            each step takes its block. Data that `fit` shuffles is copied
            to every device, and each step gathers its rows from its copy.
            `None` (default): when what a device holds (a copy, or its
            share of blocks) is within `device_resident_budget`; otherwise
            the host path. `True`: always; then shuffled data
            (`shuffle=True`) whose copy is over the budget is split over
            the replicas by rows, and each pass lays its batches out once
            from them as blocks (an `all_to_all`): 1/replicas of it a
            device, but on CPU devices slower than the host path (BR in
            `benchmarks/single_vs_mirrored.py`). `False`: never. With several
            processes it is ignored (batches are laid out step by step, on
            a background thread).
        device_resident_budget: the bytes of a dataset one device's memory
            may hold: the whole dataset for a copy, 1/replicas of it split.
            CPU devices share the host's memory, which then holds every
            device's part: a copy on each counts replicas times the dataset.
            `None` (default): a quarter of the free memory of the device
            with the least, as the backend reports it when the data is laid
            out (`memory_stats()` on GPU and TPU); 256 MiB where it reports
            none (CPU).
        fuse_steps: with `steps_per_execution=N > 1` in `compile`, run each
            group of N batches of the same shapes as one compiled program
            (a `lax.scan` of the step): one dispatch per N steps instead of
            N, the same numbers. `False`: Keras's loop of N compiled steps.
            Defaults to `True`. On CPU devices a step with a convolution
            always runs through Keras's loop (XLA:CPU runs convolutions in
            a loop several times slower: `training/_fused_steps.py`).
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    device_resident: bool | None = None
    device_resident_budget: int | None = None
    fuse_steps: bool = True

    def __post_init__(self) -> None:
        if self.device_resident_budget is not None:
            check_int(
                self.device_resident_budget,
                name="device_resident_budget",
                minimum=0,
                meaning=" (bytes per device) or None (from the devices' free memory)",
            )
        if self.device_resident not in (None, True, False):
            raise ValueError(
                "`device_resident` must be True, False or None (automatic). "
                f"Received: device_resident={self.device_resident!r}."
            )
        if self.fuse_steps not in (True, False):
            raise ValueError(
                "`fuse_steps` must be True or False. "
                f"Received: fuse_steps={self.fuse_steps!r}."
            )
        check_int(
            self.experimental_per_replica_buffer_size,
            name="experimental_per_replica_buffer_size",
        )
