"""`OneDeviceStrategy`: everything on one device, same code path."""

import jax

from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._devices import resolve_device

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Runs on a single device, through the same code path as the others.

    Like `tf.distribute.OneDeviceStrategy`: variables and computation live on
    `device`. Useful to switch a distributed script to one device by changing
    one line, and as the reference a multi-device run must match.

    Example:

    ```python
    strategy = keras_dist.OneDeviceStrategy("cpu:0")   # or "/gpu:0"
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)
    ```

    Args:
        device: the device, as a string (`"gpu:0"`, `"/GPU:0"`, `"cpu:0"`,
            `"/job:localhost/replica:0/task:0/device:CPU:0"`) or a `jax.Device`.

    Raises:
        ValueError: if `device` is not a device spec.
        keras_dist.errors.DeviceNotFoundError: if the device is not visible.
    """

    def __init__(self, device: "str | jax.Device"):
        super().__init__((resolve_device(device, argument="device"),))
