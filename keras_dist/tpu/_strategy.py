"""`TPUStrategy`: synchronous data parallelism over every TPU core."""

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import keras
import numpy as np

from keras_dist.cluster._tpu_resolver import TPUClusterResolver, joined
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._join import agree_on_seed
from keras_dist.strategies.devices._mesh import check_model_parallel
from keras_dist.strategies.state._model_layout import sharded_state
from keras_dist.strategies.state._state_layout import (
    SHARD_OPTIMIZER_STATE,
    SHARD_VARIABLES,
)
from keras_dist.tpu._mesh import tpu_device_order

__all__ = ["TPUStrategy", "check_global_batch"]


class TPUStrategy(Strategy):
    """Synchronous training on every core of a TPU, a pod slice or several slices.

    Like `tf.distribute.TPUStrategy`: one replica per TPU device (a core on
    v2/v3, a chip on v4 and later), variables replicated, each global batch
    split over the replicas, gradients all-reduced by XLA over the TPU
    interconnect — here inside one compiled JAX program over a 1-D mesh
    `("batch",)` whose devices follow the TPU topology (JAX's `mesh_utils`;
    see `keras_dist/tpu/_mesh.py`). On a pod slice (several TPU
    VM hosts) it first joins the hosts into one JAX cluster, as
    `MultiWorkerMirroredStrategy` does: run the same program on every host.

    Example:

    ```python
    resolver = kd.cluster.TPUClusterResolver()   # ValueError without a TPU
    strategy = kd.TPUStrategy(resolver)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=32)
    model.fit(x, y, batch_size=128 * strategy.num_replicas_in_sync)
    ```

    Args:
        tpu_cluster_resolver: a `kd.cluster.TPUClusterResolver`. Defaults to
            `TPUClusterResolver()`: the TPU of this VM.
        experimental_device_assignment: must be `None`. tf's
            `DeviceAssignment` places one replica on several cores (model
            parallelism: here `model_parallel`) or on a subset of them (here
            `kd.MirroredStrategy(["tpu:0", "tpu:1"])`).
        model_parallel: devices per replica: a 2-D mesh `("batch", "model")`
            whose model axis follows the fastest links, inside each host.
            Defaults to 1. See `MirroredStrategy`.
        layout_map: a `keras.distribution.LayoutMap` or a function making
            one (keras-hub's `Backbone.get_layout_map`). See
            `MirroredStrategy`.
        shard_variables: FSDP over `"batch"` (see `MirroredStrategy`).
        shard_optimizer_state: ZeRO-1 over `"batch"`.
        strict: with `layout_map`, a large variable no rule matches is an
            error.

    Raises:
        keras_dist.errors.TPUNotFoundError: (a `ValueError`) if there is no
            TPU; the message names the platform found and the fix.
        TypeError: if `tpu_cluster_resolver` is not a `TPUClusterResolver`.
        ValueError: if `experimental_device_assignment` is given.
        keras_dist.errors.ClusterTimeoutError: if a host of a pod does not
            join within 300 s.
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: Any = None,
        *,
        model_parallel: int = 1,
        layout_map: Any = None,
        shard_variables: bool = False,
        shard_optimizer_state: bool = False,
        strict: bool = False,
    ):
        if experimental_device_assignment is not None:
            raise ValueError(
                "`experimental_device_assignment` is not supported: keras_dist's "
                "TPUStrategy orders every TPU device by topology. Received: "
                f"experimental_device_assignment={experimental_device_assignment!r}."
                " Leave it None; for several cores per replica (model "
                "parallelism) pass `model_parallel=k`, and for a subset of the "
                'cores use kd.MirroredStrategy(["tpu:0", "tpu:1", ...]).'
            )
        check_model_parallel(model_parallel, layout_map)
        state = sharded_state(
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
            strict=strict,
        )
        resolver = joined(
            tpu_cluster_resolver,
            argument="tpu_cluster_resolver",
            example="kd.TPUStrategy(kd.cluster.TPUClusterResolver())",
        )
        self._cluster_resolver = resolver
        agree_on_seed()
        k = model_parallel
        if isinstance(layout_map, keras.distribution.LayoutMap):
            k = int(np.shape(layout_map.device_mesh.devices)[-1])
        super().__init__(
            _as_jax_devices(tpu_device_order(resolver.devices, k)),
            state_layout=state,
            model_parallel=model_parallel,
            layout_map=layout_map,
        )

    shard_variables = SHARD_VARIABLES
    shard_optimizer_state = SHARD_OPTIMIZER_STATE

    def check_global_batch(self, batch_size: int) -> None:
        check_global_batch(self, batch_size)

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        """The `TPUClusterResolver` the strategy runs on."""
        return self._cluster_resolver


def check_global_batch(strategy: Strategy, batch_size: int) -> None:
    """Warns when a `TPUStrategy`'s global batch does not fill every TPU core.

    keras_dist pads such a batch to a multiple of the replicas (results stay
    exact), but on a TPU the padded rows cost a full step of compute on every
    core, and tf's `TPUStrategy` users expect the batch to divide. Other
    strategies pad cheaply and are not warned.

    Args:
        strategy: the strategy of the call.
        batch_size: the global batch size of `fit`/`evaluate`/`predict`.
    """
    if not isinstance(strategy, TPUStrategy):
        return
    cores = strategy.num_replicas_in_sync
    if batch_size % cores == 0:
        return
    below, above = batch_size // cores * cores, (batch_size // cores + 1) * cores
    suggestion = f"{above}" if below == 0 else f"{below} or {above}"
    warnings.warn(
        f"The global batch size {batch_size} is not a multiple of the {cores} TPU "
        f"cores of {strategy!r}: each batch is padded to {above} rows, so "
        f"{above - batch_size} rows of every step are computed and discarded. "
        f"Received: batch_size={batch_size}. Use batch_size={suggestion}, e.g. "
        "batch_size = PER_CORE_BATCH * strategy.num_replicas_in_sync.",
        UserWarning,
        stacklevel=2,
    )


def _as_jax_devices(devices: Sequence[Any]) -> list[jax.Device]:
    """The mesh needs real devices; a resolver's `devices=` may only describe a TPU."""
    for device in devices:
        if not isinstance(device, jax.Device):
            raise TypeError(
                "TPUStrategy needs `jax.Device`s, but the resolver's devices only "
                f"describe a TPU. Received: {device!r}. Pass devices from "
                '`jax.devices("tpu")` to `TPUClusterResolver(devices=...)`, or '
                "leave `devices=None`."
            )
    return list(devices)
