"""`MirroredStrategy`: synchronous data parallelism over local devices."""

from collections.abc import Sequence

import jax

from keras_dist.strategies._base import Strategy
from keras_dist.strategies._devices import resolve_devices

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

    Args:
        devices: the devices to replicate over, as strings (`"gpu:0"`,
            `"/gpu:1"`, `"/job:localhost/replica:0/task:0/device:GPU:0"`,
            `"cpu:3"`) or `jax.Device`s. Defaults to `None`: every device of
            JAX's default backend in this process.

    Raises:
        ValueError: if `devices` is empty, has duplicates or mixes kinds.
        keras_dist.errors.DeviceNotFoundError: if a device is not visible.
    """

    def __init__(self, devices: Sequence["str | jax.Device"] | None = None):
        super().__init__(resolve_devices(devices, argument="devices"))
