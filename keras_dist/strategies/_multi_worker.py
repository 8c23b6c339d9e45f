"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over processes."""

import dataclasses
from typing import Any

import jax

from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._join import global_devices, join_cluster
from keras_dist.strategies.devices._mesh import check_model_parallel
from keras_dist.strategies.state._model_layout import sharded_state
from keras_dist.strategies.state._state_layout import (
    SHARD_OPTIMIZER_STATE,
    SHARD_VARIABLES,
)

__all__ = ["CommunicationOptions", "MultiWorkerMirroredStrategy"]

_IMPLEMENTATIONS = ("auto", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How the processes talk, as `tf.distribute.experimental.CommunicationOptions`.

    The collectives themselves are XLA's (NCCL on GPU, ICI on TPU, gloo or MPI
    between CPU hosts), chosen by JAX; these options set the timeouts and the
    CPU implementation.

    Example:

    ```python
    options = kd.CommunicationOptions(timeout_seconds=60)  # fail within a minute
    strategy = kd.MultiWorkerMirroredStrategy(communication_options=options)
    ```

    Args:
        timeout_seconds: how long joining the cluster, and each cross-process
            check keras_dist makes (start of `fit`, input agreement), may
            wait for a peer before failing with `ClusterTimeoutError`.
            Defaults to 300.
        implementation: CPU collectives, `"auto"` (gloo), `"gloo"` or `"mpi"`.

    Raises:
        ValueError: for a non-positive timeout or an unknown implementation.
    """

    timeout_seconds: float = 300.0
    implementation: str = "auto"

    def __post_init__(self) -> None:
        t = self.timeout_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(
                "`timeout_seconds` must be a positive number of seconds. "
                f"Received: timeout_seconds={t!r}."
            )
        if self.implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"`implementation` must be one of {list(_IMPLEMENTATIONS)}. "
                f"Received: implementation={self.implementation!r}. (On GPU and "
                "TPU JAX always uses NCCL / ICI.)"
            )


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training over every device of every process (host).

    Like `tf.distribute.MultiWorkerMirroredStrategy`: each process (worker)
    runs the same program; the strategy joins the JAX cluster (from
    TF_CONFIG, SLURM, `keras-dist-run`, JAX's own detection, or
    `cluster_resolver`), then replicates variables over all devices of all
    processes and splits each global batch over them.

    `batch_size` stays the *global* batch. Give every process the same full
    dataset (NumPy arrays, a PyDataset, a tf.data dataset, ...): keras_dist
    splits each global batch over the processes, so training is the
    single-process training, row for row. To give each process its own data,
    use `distribute_datasets_from_function` or a tf.data dataset with
    `kd.data.AutoShardPolicy.FILE` / `OFF`. Only the chief (process 0)
    prints progress and writes checkpoints and logs; `predict` returns the
    full result on every process.

    Example:

    ```python
    strategy = kd.MultiWorkerMirroredStrategy()   # reads TF_CONFIG / SLURM / ...
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64 * strategy.num_replicas_in_sync, epochs=3)
    ```

    `shard_variables=True` (FSDP) and `shard_optimizer_state=True` (ZeRO-1)
    split the variables and/or their optimizer slots over every device of
    every process, as for `MirroredStrategy`: each device holds 1/N of them.

    Args:
        cluster_resolver: a `kd.cluster` resolver; defaults to detection.
        communication_options: a `CommunicationOptions` (timeouts).
        shard_variables: split variables (and their optimizer slots) over
            all devices. Defaults to `False`: replicated.
        shard_optimizer_state: split only the optimizer slots (ZeRO-1).
            Defaults to `False`.
        model_parallel: devices per replica: a 2-D mesh `("batch", "model")`
            whose rows (replicas) stay inside one process; `"batch"` spans
            the processes. Must divide each process's devices. Defaults to 1.
        layout_map: a `keras.distribution.LayoutMap` or a function making
            one (keras-hub's `Backbone.get_layout_map`); see
            `MirroredStrategy`.
        strict: with `layout_map`, a large variable no rule matches is an
            error.

    Raises:
        ClusterConfigError: for a cluster with `ps` tasks, or a bad resolver.
        ClusterTimeoutError: if the cluster does not form within the timeout.
        RuntimeError: if JAX already started its devices before the cluster
            was joined (create the strategy first).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        model_parallel: int = 1,
        layout_map: Any = None,
        shard_variables: bool = False,
        shard_optimizer_state: bool = False,
        strict: bool = False,
    ):
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                "`communication_options` must be a `kd.CommunicationOptions`. "
                f"Received: {communication_options!r}."
            )
        check_model_parallel(model_parallel, layout_map)
        state = sharded_state(
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
            strict=strict,
        )
        self._communication_options = communication_options
        self._cluster_resolver = join_cluster(
            cluster_resolver,
            timeout=communication_options.timeout_seconds,
            implementation=communication_options.implementation,
            strategy_name="MultiWorkerMirroredStrategy",
        )
        super().__init__(
            global_devices(),
            state_layout=state,
            model_parallel=model_parallel,
            layout_map=layout_map,
        )

    shard_variables = SHARD_VARIABLES
    shard_optimizer_state = SHARD_OPTIMIZER_STATE

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolved cluster (addresses, this process's role)."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._communication_options

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (process 0: it writes and prints)."""
        return jax.process_index() == 0

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(num_processes={self.num_processes}, "
            f"process_id={self.process_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    __str__ = __repr__
