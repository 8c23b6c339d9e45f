"""Where a save's host CPU goes: each part of a checkpoint save timed alone.

Builds the MLP of `checkpointing.py` (Adam state: ~100 MB) under
MirroredStrategy(shard_variables=True) (`fsdp`) or MirroredStrategy
(`mirrored`) on 8 virtual CPU devices, takes one optimizer step, then times
each part of a save `--repeats` times with no training beside it: the
process's CPU time (every thread), wall time and minor page faults.

    freeze        keras_dist's freeze of the state (a copy on the devices)
    raw_bytes     the frozen arrays' parts written to one file (the floor)
    backup        kd.callbacks.BackupAndRestore's synchronous write (Orbax)
    weights_h5    model.save_weights(".weights.h5") (keras_dist's writer)

    python benchmarks/save_cost.py                  # fsdp and mirrored, ~1 min
    python benchmarks/save_cost.py --layouts fsdp --repeats 8
    python benchmarks/save_cost.py --no-gc-pause    # Orbax's writes as before

Each part's CPU time in Python's cyclic garbage collector is counted too
(`gc.callbacks`): keras_dist pauses the collector during its Orbax writes;
`--no-gc-pause` leaves it running (writes `save_cost_no_gc_pause.*`).

Writes `save_cost.{json,md}` to `--out` (the median of the repeats; the
first is left out of it: it compiles and warms the caches).
"""

import argparse
import os
import pathlib
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

from _runs import force_host_devices, machine, write_results

HERE = pathlib.Path(__file__).resolve().parent
PARTS = ["freeze", "raw_bytes", "backup", "weights_h5"]


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="fsdp,mirrored")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument(
        "--no-gc-pause",
        action="store_true",
        help="Orbax's writes with Python's garbage collector running",
    )
    return p


class _Collections:
    """CPU seconds in Python's cyclic garbage collector, and collections."""

    def __init__(self):
        import gc

        self.seconds, self.count, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._record)

    def _record(self, phase, info):
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._start
            self.count += 1


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _model(layout: str):
    import keras
    import numpy as np

    import keras_dist as kd

    width, depth, batch = 1024, 8, 64  # checkpointing.py's 100mb: 96 MB.
    strategy = kd.MirroredStrategy(shard_variables=layout == "fsdp")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        layers = [keras.Input((width,))]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        model = keras.Sequential([*layers, keras.layers.Dense(10)])
        model.compile(
            keras.optimizers.Adam(1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    model.fit(x, rng.integers(0, 10, batch), batch_size=batch, verbose=0)
    return model


def _parts(model, directory: str) -> dict:
    import jax
    import numpy as np

    from keras_dist._keras_compat._freeze import freeze
    from keras_dist.callbacks._backup_store import BackupStore

    state = list(model.variables) + list(model.optimizer.variables)
    store = BackupStore(os.path.join(directory, "backup"), async_save=False)
    frozen: list = []
    count = iter(range(10**6))

    def do_freeze():
        frozen[:] = jax.block_until_ready(freeze(state))

    def raw_bytes():
        with open(os.path.join(directory, "raw.bin"), "wb") as f:
            for a in frozen:
                for shard in a.addressable_shards:
                    f.write(memoryview(np.ascontiguousarray(shard.data)))

    def backup():
        store.save(model, next(count), {})

    def weights_h5():
        model.save_weights(os.path.join(directory, "m.weights.h5"))

    return {
        "freeze": do_freeze,
        "raw_bytes": raw_bytes,
        "backup": backup,
        "weights_h5": weights_h5,
    }


def main():
    args = _parser().parse_args()
    force_host_devices(8)
    os.environ["KERAS_BACKEND"] = "jax"
    import jax

    if args.no_gc_pause:
        import contextlib

        from keras_dist.callbacks import _backup_store

        _backup_store.collection_paused = contextlib.nullcontext
    collections = _Collections()
    rows = []
    for layout in args.layouts.split(","):
        model = _model(layout)
        state_mb = (
            sum(v.value.nbytes for v in model.variables + model.optimizer.variables)
            / 2**20
        )
        directory = tempfile.mkdtemp(prefix="kd-save-cost-")
        try:
            parts = _parts(model, directory)
            for name in PARTS:
                samples = []
                for _ in range(args.repeats):
                    (cpu, faults), start = _usage(), time.perf_counter()
                    gc_s, gc_n = collections.seconds, collections.count
                    parts[name]()
                    wall = time.perf_counter() - start
                    cpu2, faults2 = _usage()
                    samples.append(
                        (
                            1000 * (cpu2 - cpu),
                            1000 * wall,
                            faults2 - faults,
                            1000 * (collections.seconds - gc_s),
                            collections.count - gc_n,
                        )
                    )
                later = samples[1:] or samples
                row = {
                    "layout": layout,
                    "part": name,
                    "state_mb": state_mb,
                    "cpu_ms": statistics.median(s[0] for s in later),
                    "wall_ms": statistics.median(s[1] for s in later),
                    "faults": statistics.median(s[2] for s in later),
                    "gc_ms": statistics.mean(s[3] for s in later),
                    "collections": statistics.mean(s[4] for s in later),
                    "first_cpu_ms": samples[0][0],
                    "samples": samples,
                }
                row["cpu_ms_per_mb"] = row["cpu_ms"] / state_mb
                rows.append(row)
                print(
                    f"{layout} {name}: {row['cpu_ms']:.0f} ms CPU, "
                    f"{row['wall_ms']:.0f} ms wall",
                    flush=True,
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    import datetime

    payload = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine("cpu", len(jax.devices())),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "gc_pause": not args.no_gc_pause,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "rows": rows,
    }
    stem = "save_cost_no_gc_pause" if args.no_gc_pause else "save_cost"
    write_results(args.out, stem, payload, markdown, lambda *_: False)


def markdown(payload: dict) -> str:
    out = [
        f"Measured {payload['date']} on {payload['machine']} "
        f"(`python benchmarks/{payload['command']}`): each part of a save "
        "timed alone, no training beside it; the median of "
        f"{payload['repeats'] - 1} repeats after a first (compiling, "
        "warming). CPU: the process's, every thread. Garbage collector: "
        "the mean of its CPU time and collections in a call (the Orbax "
        "writes with it "
        + ("paused" if payload.get("gc_pause", True) else "running")
        + ").",
        "",
        "| layout | part | state MB | CPU ms | CPU ms per MB | wall ms | "
        "minor page faults | garbage collector ms | collections | first "
        "call CPU ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        out.append(
            f"| {r['layout']} | {r['part']} | {r['state_mb']:.0f} | "
            f"{r['cpu_ms']:.0f} | {r['cpu_ms_per_mb']:.2f} | {r['wall_ms']:.0f} | "
            f"{r['faults']:.0f} | {r['gc_ms']:.1f} | {r['collections']:.1f} | "
            f"{r['first_cpu_ms']:.0f} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
