"""The tf.distribute Keras tutorial's CNN on MirroredStrategy, offline.

Trains Conv2D(32) -> MaxPool -> Flatten -> Dense(64) -> Dense(10) on
scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with
scikit-learn: no download) with `MirroredStrategy` over every local device,
8 virtual CPU devices when there is no accelerator. 1,293 training images are
not a multiple of the global batch, so every epoch ends on a partial batch.

With the tutorial's callbacks: `ModelCheckpoint("ckpt_{epoch}")`, a stepped
`LearningRateScheduler`, `PrintLR`, and `BackupAndRestore`. The run is
preempted (SIGTERM) mid-epoch, then resumed from its backup; the checkpoint
files are listed and the latest is evaluated. Finally the same training on
`OneDeviceStrategy`, uninterrupted, gives the one-line comparison.

    python examples/digits_cnn.py [--epochs 12] [--batch-per-replica 16]
        [--preempt-at-step 40] [--workdir digits_run]
"""

import argparse
import os
import shutil
import signal
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


def decay(epoch: int) -> float:
    """The tutorial's stepped schedule, scaled for this small problem."""
    if epoch < 6:
        return 3e-3
    elif epoch < 10:
        return 1e-3
    return 3e-4


class _EpochPrinter(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(
            f"epoch {epoch + 1:2d}  loss {logs['loss']:.4f}  "
            f"accuracy {logs['accuracy']:.4f}  val_loss {logs['val_loss']:.4f}  "
            f"val_accuracy {logs['val_accuracy']:.4f}"
        )


class _Preempt(keras.callbacks.Callback):
    """Sends this process SIGTERM after a given global step (a preemption)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(np.asarray(self.model.optimizer.iterations.value)) == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def build(strategy, initial_weights) -> keras.Model:
    with strategy.scope():
        model = create_model()
        model.set_weights(initial_weights)
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def train(model, data, *, global_batch, epochs, callbacks):
    x_train, _, y_train, _ = data
    keras.utils.set_random_seed(1)  # The same shuffling in every run.
    return model.fit(
        x_train,
        y_train,
        batch_size=global_batch,
        epochs=epochs,
        validation_split=0.1,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-per-replica", type=int, default=16)
    parser.add_argument(
        "--preempt-at-step",
        type=int,
        default=40,
        help="simulate a preemption after this step (0: never)",
    )
    parser.add_argument("--workdir", default="digits_run")
    args = parser.parse_args(argv)

    data = load_data()
    keras.utils.set_random_seed(0)
    initial_weights = create_model().get_weights()
    shutil.rmtree(args.workdir, ignore_errors=True)
    checkpoint_dir = os.path.join(args.workdir, "training_checkpoints")
    backup_dir = os.path.join(args.workdir, "backup")

    mirrored = kd.MirroredStrategy()
    global_batch = args.batch_per_replica * mirrored.num_replicas_in_sync
    print(f"{mirrored}")
    print(
        f"{len(data[0])} images ({int(len(data[0]) * 0.9)} for training), global "
        f"batch {global_batch} = {args.batch_per_replica} per replica x "
        f"{mirrored.num_replicas_in_sync}; last batch of each epoch: "
        f"{int(len(data[0]) * 0.9) % global_batch} images"
    )

    def callbacks(extra=()):
        return [
            kd.callbacks.BackupAndRestore(backup_dir, save_freq=10),
            kd.callbacks.ModelCheckpoint(
                os.path.join(checkpoint_dir, "ckpt_{epoch}"), save_weights_only=True
            ),
            kd.callbacks.LearningRateScheduler(decay),
            kd.callbacks.PrintLR(),
            _EpochPrinter(),
            *extra,
        ]

    common = {"global_batch": global_batch, "epochs": args.epochs}
    start = time.perf_counter()
    if args.preempt_at_step:
        model = build(mirrored, initial_weights)
        try:
            train(
                model,
                data,
                callbacks=callbacks([_Preempt(args.preempt_at_step)]),
                **common,
            )
        except SystemExit:
            print(f"-- SIGTERM after step {args.preempt_at_step}; restarting --")
    model = build(mirrored, initial_weights)  # As a restarted process would.
    history = train(model, data, callbacks=callbacks(), **common)
    t_m = time.perf_counter() - start

    print("checkpoints:", sorted(os.listdir(checkpoint_dir)))
    model.load_weights(kd.callbacks.latest_checkpoint(checkpoint_dir))
    loss_m, acc_m = model.evaluate(data[1], data[3], batch_size=global_batch, verbose=0)
    print(f"test loss {loss_m:.4f}  test accuracy {acc_m:.4f}")

    one = kd.OneDeviceStrategy(mirrored.devices[0])
    reference = build(one, initial_weights)
    start = time.perf_counter()
    train(
        reference, data, callbacks=[kd.callbacks.LearningRateScheduler(decay)], **common
    )
    t_o = time.perf_counter() - start
    _, acc_o = reference.evaluate(data[1], data[3], batch_size=global_batch, verbose=0)
    max_diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True)
    )
    print(
        f"OneDeviceStrategy: test accuracy {acc_o:.4f} in {t_o:.1f} s | "
        f"MirroredStrategy x{mirrored.num_replicas_in_sync} (preempted and resumed): "
        f"test accuracy {acc_m:.4f} in {t_m:.1f} s | max |weight difference| "
        f"{max_diff:.1e}"
    )
    return {
        "history": history.history,
        "test_accuracy": acc_m,
        "one_device_accuracy": acc_o,
        "max_weight_difference": max_diff,
    }


if __name__ == "__main__":
    main()
