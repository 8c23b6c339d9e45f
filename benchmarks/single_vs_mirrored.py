"""Single device vs MirroredStrategy: training throughput of the demo CNN.

Trains the tf.distribute tutorial's CNN (examples/digits_cnn.py) with the same
global batch on `OneDeviceStrategy` and on `MirroredStrategy` over 2, 4, 8...
devices, times the epochs after the first (compilation excluded), and prints a
table and writes it as JSON. Each run also reports its final loss, which must
be the same for every strategy (exactness is tested in tests/test_fidelity.py;
here it shows the runs did the same work).

On CPU the "devices" are virtual (XLA_FLAGS=--xla_force_host_platform_device_count)
and share the machine's cores, so no speed-up is expected there: the numbers
measure keras_dist's overhead. On GPUs/TPUs they measure the scaling.

    python benchmarks/single_vs_mirrored.py [--epochs 4] [--global-batch 128]
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras

import keras_dist as kd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from digits_cnn import create_model, load_data

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class _EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def run(strategy, data, weights, *, global_batch, epochs):
    x_train, _, y_train, _ = data
    with strategy.scope():
        model = create_model()
        model.set_weights(weights)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    timer = _EpochTimer()
    history = model.fit(
        x_train,
        y_train,
        batch_size=global_batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    steady = timer.seconds[1:] or timer.seconds
    epoch_s = statistics.median(steady)
    return {
        "strategy": repr(strategy),
        "replicas": strategy.num_replicas_in_sync,
        "first_epoch_s": round(timer.seconds[0], 4),
        "epoch_s": round(epoch_s, 4),
        "examples_per_s": round(len(x_train) / epoch_s, 1),
        "final_loss": float(history.history["loss"][-1]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "single_vs_mirrored.json"))
    args = parser.parse_args(argv)

    data = load_data()
    keras.utils.set_random_seed(0)
    weights = create_model().get_weights()
    local = jax.local_devices()
    strategies = [kd.OneDeviceStrategy(local[0])]
    n = 2
    while n <= len(local):
        strategies.append(kd.MirroredStrategy(local[:n]))
        n *= 2
    rows = [
        run(s, data, weights, global_batch=args.global_batch, epochs=args.epochs)
        for s in strategies
    ]
    base = rows[0]["epoch_s"]
    print(
        f"digits CNN, {len(data[0])} images, global batch {args.global_batch}, "
        f"{args.epochs} epochs, {local[0].platform} x{len(local)}"
    )
    print(
        f"{'replicas':>8} {'epoch s':>9} {'examples/s':>11} {'vs 1':>6} "
        f"{'1st epoch s':>12} {'final loss':>11}"
    )
    for row in rows:
        row["speedup"] = round(base / row["epoch_s"], 3)
        print(
            f"{row['replicas']:>8} {row['epoch_s']:>9.3f} "
            f"{row['examples_per_s']:>11.1f} "
            f"{row['speedup']:>6.2f} {row['first_epoch_s']:>12.2f} "
            f"{row['final_loss']:>11.6f}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "single_vs_mirrored",
        "platform": local[0].platform,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {
            "jax": jax.__version__,
            "keras": keras.__version__,
            "keras_dist": kd.__version__,
        },
        "global_batch": args.global_batch,
        "epochs": args.epochs,
        "rows": rows,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
