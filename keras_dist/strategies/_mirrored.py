"""`MirroredStrategy`: synchronous data parallelism over local devices."""

from collections.abc import Sequence
from typing import Any

import jax

from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._devices import resolve_devices
from keras_dist.strategies.devices._mesh import check_model_parallel
from keras_dist.strategies.state._model_layout import sharded_state
from keras_dist.strategies.state._state_layout import (
    SHARD_OPTIMIZER_STATE,
    SHARD_VARIABLES,
)

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy):
    """Synchronous training on many devices of one machine.

    Like `tf.distribute.MirroredStrategy`: one replica per device, variables
    replicated on every device, each global batch split evenly over the
    replicas and gradients all-reduced, all inside one compiled XLA program
    over a 1-D `jax.sharding.Mesh` with the axis `"batch"`.

    Example:

    ```python
    strategy = keras_dist.MirroredStrategy()   # every local GPU/TPU, else CPU
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)             # 64 = global batch
    ```

    With `shard_variables=True` (FSDP / ZeRO-3) each variable, and with it
    its optimizer slots, is created split over the devices along its largest
    dimension divisible by the number of replicas (others stay replicated):
    each device holds 1/N of those bytes, and XLA gathers a weight where a
    step needs it. The numbers are those of the replicated run (to float
    rounding). With `shard_optimizer_state=True` (ZeRO-1) only the optimizer
    slots are split that way. `strategy.memory_report(model)` shows what went
    where.

    With `model_parallel=k` a model too big for one device is split over
    k devices: the mesh is 2-D, `("batch", "model")` of shape `(N / k, k)`,
    a replica is a row of k devices (`num_replicas_in_sync == N / k`) and
    the global batch is split over the rows. Each variable is split over
    `"model"` by the rules of `layout_map` (keras-hub's
    `Backbone.get_layout_map`) or automatically (attention heads, the wide
    side of feed-forward kernels, the vocabulary of embeddings); see
    `keras_dist/strategies/state/_model_layout.py`.

    ```python
    strategy = kd.MirroredStrategy(
        model_parallel=4, layout_map=keras_hub.models.GemmaBackbone.get_layout_map
    )
    ```

    Args:
        devices: the devices to replicate over, as strings (`"gpu:0"`,
            `"/gpu:1"`, `"/job:localhost/replica:0/task:0/device:GPU:0"`,
            `"cpu:3"`) or `jax.Device`s. Defaults to `None`: every device of
            JAX's default backend in this process.
        model_parallel: devices per replica (the `"model"` axis). Defaults
            to 1: one device per replica.
        layout_map: a `keras.distribution.LayoutMap` whose mesh (axes
            `("batch", "model")`, the strategy's devices) decides the shape,
            or a function making one from `strategy.device_mesh`. Defaults to
            None: automatic layouts when `model_parallel > 1`.
        shard_variables: split variables (and their optimizer slots) over
            the devices. Defaults to `False`: replicated.
        shard_optimizer_state: split only the optimizer slots (moments,
            momentum, gradient accumulators) over the devices, weights
            replicated (ZeRO-1): bit-identical to the replicated run. Defaults
            to `False`.
        strict: with `layout_map`, a variable of 1 MiB or more that no rule
            matches is an error instead of a warning. Defaults to `False`.

    Raises:
        ValueError: if `devices` is empty, has duplicates or mixes kinds.
        keras_dist.errors.DeviceNotFoundError: if a device is not visible.
    """

    def __init__(
        self,
        devices: Sequence["str | jax.Device"] | None = None,
        *,
        model_parallel: int = 1,
        layout_map: Any = None,
        shard_variables: bool = False,
        shard_optimizer_state: bool = False,
        strict: bool = False,
    ):
        check_model_parallel(model_parallel, layout_map)
        state = sharded_state(
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
            strict=strict,
        )
        super().__init__(
            resolve_devices(devices, argument="devices"),
            state_layout=state,
            model_parallel=model_parallel,
            layout_map=layout_map,
        )

    shard_variables = SHARD_VARIABLES
    shard_optimizer_state = SHARD_OPTIMIZER_STATE
