"""What the device-resident input tests share: data, options, a spy."""

import keras

import keras_dist as kd
from keras_dist.data import _call
from tests._helpers import initial_weights, make_data

X, Y, SW = make_data(37)
WEIGHTS = initial_weights()
# Always on the devices; no copy fits a budget of 0 bytes: data `fit`
# shuffles is split over the replicas by rows (`ROWS`), not copied.
SPLIT = kd.InputOptions(device_resident=True, device_resident_budget=0)


def resident_options(resident) -> kd.InputOptions:
    """`"split"`: `SPLIT`; otherwise `device_resident=resident`."""
    if resident == "split":
        return SPLIT
    return kd.InputOptions(device_resident=resident)


class ResidentSpy(keras.callbacks.Callback):
    """Counts the datasets laid out on the mesh in the running call."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def _record(self, name):
        self.counts[name] = len(_call.active().root.resident)

    def on_train_end(self, logs=None):
        self._record("fit")

    def on_test_end(self, logs=None):
        self._record("evaluate")

    def on_predict_end(self, logs=None):
        self._record("predict")
