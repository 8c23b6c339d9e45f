"""How many keras_dist files one `fit` batch goes through, and in which order.

Trains the tiny model (Flatten -> Dense(10) on 28x28 inputs, batch 256, 32
steps an epoch) under `kd.MirroredStrategy()` on 8 virtual CPU devices, for
two epochs, once per input path:

    numpy    NumPy arrays (device-resident: laid out on the mesh once)
    tf.data  a batched tf.data.Dataset (the host path: read, pad, lay out)

During the second epoch (steady state: every program compiled) a
`sys.setprofile` / `threading.setprofile` hook records every Python call
into a keras_dist file, on every thread (the prefetch thread included).
Prints, per path: the keras_dist files that ran code, the calls per batch,
and the order of layers one steady-state batch crosses (DESIGN.md's layers:
seams, callbacks, training, strategies, input, cluster), with the number of
reversals (the batch going back into a layer it had left):

- on the step loop's thread, its road: from Keras's loop asking for the
  next step (the seams' `_enumerate_iterator`) to the step dispatched and
  paced (`Pacer.after`); what runs after it until the next step (Keras's
  per-step callback hooks) is shown apart;
- on the thread producing batches ahead (the host path's prefetch), the
  production of one batch: from one resumption of its source to the next.

Writes `--out/batch_path.json`.

    python benchmarks/batch_path.py
    python benchmarks/batch_path.py --steps 64 --paths numpy
"""

import argparse
import collections
import datetime
import itertools
import json
import os
import pathlib
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "jax")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

HERE = pathlib.Path(__file__).resolve().parent
PATHS = ("numpy", "tf.data")
# DESIGN.md's layers, top (seams) to bottom (cluster), by folder.
LAYERS = {
    "_seams": "seams",
    "_private_api": "private API",
    "callbacks": "callbacks",
    "failure_handling": "callbacks",
    "training": "training",
    "layers": "training",
    "utils": "training",
    "strategies": "strategies",
    "tpu": "strategies",
    "data": "input",
    "cluster": "cluster",
}
# One batch's road on the step loop's thread: from Keras's loop asking for
# the next step (the seams' `_enumerate_iterator`) to the step dispatched and
# paced (`Placement`'s `Pacer.after`). Keras's per-step hooks follow it.
_LOOP_CALL = "_enumerate_iterator"
_PACED = ("after", "_first_array")
# On the thread producing batches ahead: from one resumption of its source
# (the prefetcher's `_ended`) to the next.
_PRODUCER_CALL = "_ended"


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32, help="steps per epoch")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list")
    p.add_argument("--out", default=str(HERE / "results"), help="output folder")
    return p


def _layer(relative: str) -> str:
    parts = relative.split("/")
    return LAYERS.get(parts[1], "package") if len(parts) > 2 else "package"


class _Recorder:
    """Calls into keras_dist files, in order, from every thread."""

    def __init__(self, root: str):
        self.root = root
        # (thread id, relative file, function name)
        self.calls: list[tuple[int, str, str]] = []
        self.steps = 0

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(self.root):
            relative = "keras_dist/" + filename[len(self.root) :].lstrip("/")
            self.calls.append((threading.get_ident(), relative, frame.f_code.co_name))


def _model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28)),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def measure(path: str, steps: int) -> dict:
    """Records the second epoch of a fit on `path` input."""
    import keras
    import numpy as np

    import keras_dist as kd

    batch = 256
    rng = np.random.RandomState(0)
    x = rng.rand(batch * steps, 28, 28).astype("float32")
    y = rng.randint(0, 10, size=batch * steps).astype("int32")
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = _model(keras)
    if path == "tf.data":
        import tensorflow as tf

        data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)}
    else:
        data = {"x": x, "y": y, "batch_size": batch, "shuffle": False}
    root = os.path.dirname(kd.__file__)
    recorder = _Recorder(root)

    class Hook(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                threading.setprofile(recorder)
                sys.setprofile(recorder)

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                sys.setprofile(None)
                threading.setprofile(None)

    model.fit(**data, epochs=2, verbose=0, callbacks=[Hook()])
    files = collections.Counter(name for _, name, _ in recorder.calls)
    # One steady-state batch (the second of the epoch), as the sequence of
    # layers its calls cross (consecutive repeats collapsed).
    main = threading.main_thread().ident
    on_main = [call for call in recorder.calls if call[0] == main]
    starts = [i for i, (_, _, f) in enumerate(on_main) if f == _LOOP_CALL]
    window = on_main[starts[1] : starts[2]] if len(starts) > 2 else []
    paced = [i for i, (_, _, f) in enumerate(window) if f in _PACED]
    road = window[: paced[-1] + 1] if paced else window
    after_step = window[len(road) :]
    produced = [call for call in recorder.calls if call[0] != main]
    begins = [i for i, (_, _, f) in enumerate(produced) if f == _PRODUCER_CALL]
    producer = produced[begins[1] : begins[2]] if len(begins) > 2 else []
    sequence = _collapsed([name for _, name, _ in road])
    producer_sequence = _collapsed([name for _, name, _ in producer])
    return {
        "path": path,
        "steps": steps,
        "files": dict(sorted(files.items())),
        "file_count": len(files),
        "calls_per_batch": round(len(recorder.calls) / steps, 1),
        "layer_sequence_of_one_batch": sequence,
        "producer_sequence_of_one_batch": producer_sequence,
        "after_the_step": _collapsed([name for _, name, _ in after_step]),
        "reversals": _reversals(sequence),
        "producer_reversals": _reversals(producer_sequence),
    }


def _collapsed(files: list[str]) -> list[str]:
    """The layers of `files`, consecutive repeats collapsed."""
    layers = [_layer(name) for name in files]
    return [g for i, g in enumerate(layers) if i == 0 or layers[i - 1] != g]


def _reversals(sequence: list[str]) -> int:
    """How often the batch goes back into a layer it had left (back-and-forth)."""
    left, count = set(), 0
    for before, after in itertools.pairwise(sequence):
        left.add(before)
        count += after in left
    return count


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(
            f"--paths must name {list(PATHS)}. Received: --paths={args.paths!r}."
        )
    results = [measure(path, args.steps) for path in paths]
    for result in results:
        print(
            f"\n{result['path']}: {result['file_count']} keras_dist files, "
            f"{result['calls_per_batch']} calls a batch, "
            f"{result['reversals']} reversals between layers "
            f"({result['producer_reversals']} producing it ahead)"
        )
        for name, count in result["files"].items():
            print(f"  {count / result['steps']:7.1f} calls/batch  {name}")
        print("  one batch: " + " -> ".join(result["layer_sequence_of_one_batch"]))
        if result["producer_sequence_of_one_batch"]:
            producer = result["producer_sequence_of_one_batch"]
            print("  produced ahead: " + " -> ".join(producer))
        print("  after its step: " + " -> ".join(result["after_the_step"]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "results": results,
    }
    (out / "batch_path.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out / 'batch_path.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
