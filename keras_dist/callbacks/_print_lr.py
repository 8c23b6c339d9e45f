"""`PrintLR`: print the learning rate each epoch used."""

import keras

from keras_dist.callbacks._chief import is_chief
from keras_dist.callbacks._lr_control import current_learning_rate

__all__ = ["PrintLR"]


class PrintLR(keras.callbacks.Callback):
    """Prints "Learning rate for epoch N is X" at the end of every epoch.

    The rate is the one the optimizer actually used for the epoch's last step,
    whether it was built with a float, a `LearningRateSchedule` or an optax
    schedule, or is driven by `LearningRateScheduler`/`LearningRateWarmup`.
    It is also added to the epoch's logs as `learning_rate`. Only the chief
    (process 0) prints.

    Example:

    ```python
    model.fit(dataset, epochs=3, callbacks=[kd.callbacks.PrintLR()])
    # Learning rate for epoch 1 is 0.001 ...
    ```
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        rate = current_learning_rate(self.model.optimizer)
        if logs is not None:
            logs["learning_rate"] = rate
        if is_chief():
            print(f"\nLearning rate for epoch {epoch + 1} is {_short(rate)}")


def _short(rate: float) -> str:
    import numpy as np

    return str(np.float32(rate))
