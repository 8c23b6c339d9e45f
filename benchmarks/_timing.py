"""What the benchmark workers time a `fit` with (import after Keras is set up)."""

import time

import keras

__all__ = ["EpochTimer"]


class EpochTimer(keras.callbacks.Callback):
    """Wall seconds of each epoch: Keras waits for the results at its end."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)
