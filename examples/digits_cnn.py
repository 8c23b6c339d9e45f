"""The tf.distribute Keras tutorial's CNN on MirroredStrategy, offline.

Trains Conv2D(32) -> MaxPool -> Flatten -> Dense(64) -> Dense(10) on
scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with
scikit-learn: no download) with `MirroredStrategy` over every local device,
8 virtual CPU devices when there is no accelerator. The training set has
1,437 images, not a multiple of the global batch, so every epoch ends on a
partial batch. Then trains the same model from the same initial weights on
`OneDeviceStrategy` and prints a one-line comparison: same numbers, and the
time each took.

    python examples/digits_cnn.py [--epochs 12] [--batch-per-replica 16]
"""

import argparse
import os
import time

# Before jax starts: 8 virtual CPU devices (ignored when GPUs/TPUs are used).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import keras_dist as kd


def load_data():
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1)
    labels = digits.target.astype("int32")
    return train_test_split(
        images, labels, test_size=0.2, random_state=0, stratify=labels
    )


def create_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def train(strategy, data, initial_weights, *, global_batch, epochs, verbose):
    x_train, x_test, y_train, y_test = data
    with strategy.scope():
        model = create_model()
        model.set_weights(initial_weights)
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    keras.utils.set_random_seed(1)  # The same shuffling in both runs.
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=global_batch,
        epochs=epochs,
        validation_split=0.1,
        shuffle=True,
        verbose=0,
        callbacks=[_EpochPrinter()] if verbose else [],
    )
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=global_batch, verbose=0)
    return history.history, model.get_weights(), loss, accuracy, seconds


class _EpochPrinter(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(
            f"epoch {epoch + 1:2d}  loss {logs['loss']:.4f}  "
            f"accuracy {logs['accuracy']:.4f}  val_loss {logs['val_loss']:.4f}  "
            f"val_accuracy {logs['val_accuracy']:.4f}"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-per-replica", type=int, default=16)
    args = parser.parse_args(argv)

    data = load_data()
    keras.utils.set_random_seed(0)
    initial_weights = create_model().get_weights()

    mirrored = kd.MirroredStrategy()
    global_batch = args.batch_per_replica * mirrored.num_replicas_in_sync
    print(f"{mirrored}")
    print(
        f"{len(data[0])} training images, global batch {global_batch} = "
        f"{args.batch_per_replica} per replica x {mirrored.num_replicas_in_sync}; "
        f"last batch of each epoch: {int(len(data[0]) * 0.9) % global_batch} images"
    )
    common = {"global_batch": global_batch, "epochs": args.epochs}
    hist_m, w_m, loss_m, acc_m, t_m = train(
        mirrored, data, initial_weights, verbose=True, **common
    )
    print(f"test loss {loss_m:.4f}  test accuracy {acc_m:.4f}")

    one = kd.OneDeviceStrategy(mirrored.devices[0])
    hist_o, w_o, _, acc_o, t_o = train(
        one, data, initial_weights, verbose=False, **common
    )
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(w_m, w_o, strict=True))
    print(
        f"OneDeviceStrategy: test accuracy {acc_o:.4f} in {t_o:.1f} s | "
        f"MirroredStrategy x{mirrored.num_replicas_in_sync}: test accuracy "
        f"{acc_m:.4f} in {t_m:.1f} s | max |weight difference| {max_diff:.1e}"
    )
    return {
        "mirrored": {"history": hist_m, "test_accuracy": acc_m, "seconds": t_m},
        "one_device": {"history": hist_o, "test_accuracy": acc_o, "seconds": t_o},
        "max_weight_difference": max_diff,
    }


if __name__ == "__main__":
    main()
