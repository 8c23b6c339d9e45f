"""`ParameterServerStrategy`: tf's name for sharded variables, run synchronously."""

import functools
from collections.abc import Callable
from typing import Any

from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._join import global_devices, join_cluster
from keras_dist.strategies.state._partitioners import FixedShardsPartitioner
from keras_dist.strategies.state._state_layout import PartitionedStateLayout

__all__ = ["ParameterServerStrategy"]

_TIMEOUT_SECONDS = 300.0  # Joining the cluster, as MultiWorkerMirroredStrategy.


class ParameterServerStrategy(Strategy):
    """Variables split over the devices by a tf partitioner; synchronous SPMD.

    This is **not** tf's asynchronous parameter-server training: there are no
    `ps` tasks, no `ClusterCoordinator` and no stale gradients. What it keeps
    is tf's `variable_partitioner`: a variable it asks to split into 2 or
    more shards is created split over every local device (`"batch"` mesh
    axis of N devices) along its largest dimension divisible by N, so each
    device holds 1/N of it; its optimizer slots follow it. Training is
    synchronous data parallelism, as `MultiWorkerMirroredStrategy`, with the
    numbers of one device. With several processes (TF_CONFIG, SLURM,
    `keras-dist-run`, or `cluster_resolver`) the mesh spans every device of
    every process, so a sharded variable is split over all of them; tf's
    `ps` tasks have no counterpart (every host is a worker).

    JAX splits a dimension over a whole mesh axis, so the partitioner's count
    decides *whether* a variable is split, not into how many parts: it is
    always N. A variable with no dimension divisible by N, a scalar, or one
    the partitioner gives 1 shard stays replicated; `memory_report(model)`
    says which and why.

    Migrating from tf: the `ClusterCoordinator` loop becomes `fit` (or
    `strategy.run` in a custom loop), as in the example.

    Example:

    ```python
    # tf: coordinator = ClusterCoordinator(strategy)
    #     coordinator.schedule(step_fn, args=(iter(per_worker_dataset),))
    strategy = kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=8
        )
    )
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64)
    print(strategy.memory_report(model))  # the split variables: 1/8 a device
    ```

    Args:
        cluster_resolver: the cluster; defaults to detection (TF_CONFIG,
            SLURM, `keras-dist-run`, else this process alone).
        variable_partitioner: a callable `(shape, dtype) -> partitions per
            axis`, e.g. `kd.partitioners.FixedShardsPartitioner(8)`. Defaults
            to `None`: every variable replicated.

    Raises:
        ValueError: for a `FixedShardsPartitioner` whose `num_shards` (>= 2)
            does not divide the number of devices.
        ClusterConfigError: for a TF_CONFIG with `ps` tasks.
        ClusterTimeoutError: if the cluster does not form within 300 s.
        TypeError: if `variable_partitioner` is not callable.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Callable | None = None,
    ):
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "`variable_partitioner` must be a callable `(shape, dtype) -> "
                "partitions`, e.g. `kd.partitioners.FixedShardsPartitioner(8)`. "
                f"Received: variable_partitioner={variable_partitioner!r}."
            )
        self._variable_partitioner = variable_partitioner
        self._cluster_resolver = join_cluster(
            cluster_resolver,
            timeout=_TIMEOUT_SECONDS,
            implementation="auto",
            strategy_name="ParameterServerStrategy",
        )
        super().__init__(
            global_devices(),
            state_layout=functools.partial(
                PartitionedStateLayout, partitioner=variable_partitioner
            ),
        )
        _check_divides_mesh(variable_partitioner, self.num_replicas_in_sync)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolved cluster (one process unless one was found)."""
        return self._cluster_resolver

    @property
    def variable_partitioner(self) -> Callable | None:
        return self._variable_partitioner


def _check_divides_mesh(partitioner: Any, devices: int) -> None:
    if not isinstance(partitioner, FixedShardsPartitioner):
        return
    shards = partitioner.num_shards
    if shards == 1 or devices % shards == 0:
        return
    raise ValueError(
        f"`num_shards` of the `variable_partitioner` must divide the {devices} "
        f"devices of the mesh (a variable is split over all of them). Received: "
        f"variable_partitioner=FixedShardsPartitioner(num_shards={shards}). "
        f"Use FixedShardsPartitioner({devices})."
    )
