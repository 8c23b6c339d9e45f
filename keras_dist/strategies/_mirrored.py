"""`MirroredStrategy`: synchronous data parallelism over local devices."""

from collections.abc import Sequence

import jax

from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._devices import resolve_devices
from keras_dist.strategies.state._state_layout import sharded_option, sharded_state

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

    Args:
        devices: the devices to replicate over, as strings (`"gpu:0"`,
            `"/gpu:1"`, `"/job:localhost/replica:0/task:0/device:GPU:0"`,
            `"cpu:3"`) or `jax.Device`s. Defaults to `None`: every device of
            JAX's default backend in this process.
        shard_variables: split variables (and their optimizer slots) over
            the devices. Defaults to `False`: replicated.
        shard_optimizer_state: split only the optimizer slots (moments,
            momentum, gradient accumulators) over the devices, weights
            replicated (ZeRO-1): bit-identical to the replicated run. Defaults
            to `False`.

    Raises:
        ValueError: if `devices` is empty, has duplicates or mixes kinds.
        keras_dist.errors.DeviceNotFoundError: if a device is not visible.
    """

    def __init__(
        self,
        devices: Sequence["str | jax.Device"] | None = None,
        *,
        shard_variables: bool = False,
        shard_optimizer_state: bool = False,
    ):
        state = sharded_state(
            shard_variables=shard_variables,
            shard_optimizer_state=shard_optimizer_state,
        )
        super().__init__(
            resolve_devices(devices, argument="devices"), state_layout=state
        )

    shard_variables = sharded_option(
        "shard_variables", "Whether variables are split over the devices (FSDP)."
    )
    shard_optimizer_state = sharded_option(
        "shard_optimizer_state",
        "Whether optimizer slots are split over the devices (ZeRO-1).",
    )
