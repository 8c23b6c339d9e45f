"""Where a save's host CPU goes: each part of a checkpoint save timed alone.

Builds the MLP of `checkpointing.py` (Adam state: ~100 MB) under
MirroredStrategy(shard_variables=True) (`fsdp`) or MirroredStrategy
(`mirrored`) on 8 virtual CPU devices, takes one optimizer step, then times
each part of a save `--repeats` times with no training beside it: the
process's CPU time (every thread), wall time and minor page faults, and
the whole machine's busy CPU time (`/proc/stat`, Linux): the kernel's work
for the write that runs in its own threads (page-cache writeback), which no
process's CPU time counts.

    freeze        keras_dist's freeze of the state (a copy on the devices)
    raw_bytes     the frozen arrays' parts written to one file (the floor)
    backup        kd.callbacks.BackupAndRestore's synchronous write (Orbax's
                  v1 Checkpointer, `_checkpoint/orbax_store.py`)
    local_backup  the same state to BackupAndRestore's local tier
                  (`local_dir`: Orbax's CheckpointManager, each process its
                  parts, `_checkpoint/local_tier.py`) in /dev/shm (where it
                  exists), saved and waited for
    weights_h5    model.save_weights(".weights.h5") (Keras's writer)
    weights_h5_background  ModelCheckpoint's `.weights.h5` writer (Keras's
                  H5IOStore from the frozen state), as its background
                  thread runs it

    python benchmarks/save_cost.py                  # fsdp and mirrored, ~1 min
    python benchmarks/save_cost.py --layouts fsdp --repeats 8

Each part then runs `--stall-repeats` times more (default: `--repeats`)
on a background thread, as an
asynchronous save's writer does, while the main thread runs Python without
pause, as a training loop that dispatches short steps does (a GPU's or
TPU's host-bound loop): "training thread stalled" is the time that thread
did not run (its wall time less its CPU time) while the part ran, waiting
for Python's lock (the GIL) or for a core; "longest stall" its longest
single wait. That is what a save costs a host-bound loop, whatever the
part's own CPU time.

Each part's CPU time in Python's cyclic garbage collector is counted too
(`gc.callbacks`). `--fit-steps N` then trains N steps with an asynchronous
`BackupAndRestore` saving every 2 steps and counts the collections on each
thread (the training thread, the others) by generation.

Writes `save_cost.{json,md}` to `--out` (the median of the repeats; the
first is left out of it: it compiles and warms the caches).
"""

import argparse
import atexit
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
PARTS = [
    "freeze",
    "raw_bytes",
    "backup",
    "local_backup",
    "weights_h5",
    "weights_h5_background",
]


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="fsdp,mirrored")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--stall-repeats",
        type=int,
        default=None,
        help="runs of each part beside a Python-bound thread (default: --repeats)",
    )
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument(
        "--fit-steps",
        type=int,
        default=0,
        help="then train this many steps, a background backup every 2",
    )
    p.add_argument(
        "--width",
        type=int,
        default=1024,
        help="the MLP's width (1024: ~100 MB of state; smaller: a smoke run)",
    )
    return p


class _Collections:
    """CPU seconds in Python's cyclic garbage collector, and collections;
    `by_thread`: (thread, generation) -> [collections, seconds, longest]."""

    def __init__(self):
        import gc
        import threading

        self.seconds, self.count = 0.0, 0
        self.by_thread: dict = {}
        self._starts: dict = {}
        self._main = threading.main_thread().ident
        self._get_ident = threading.get_ident
        gc.callbacks.append(self._record)

    def _record(self, phase, info):
        thread = self._get_ident()
        if phase == "start":
            self._starts[thread] = time.thread_time()
            return
        seconds = time.thread_time() - self._starts.pop(thread, time.thread_time())
        self.seconds += seconds
        self.count += 1
        key = ("training" if thread == self._main else "other", info["generation"])
        entry = self.by_thread.setdefault(key, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] = max(entry[2], seconds)


def _stall(part) -> tuple[float, float]:
    """Runs `part` on another thread while this one runs Python: the ms
    this thread did not run meanwhile, and its longest single stall."""
    import threading

    done, errors = threading.Event(), []

    def run():
        try:
            part()
        except BaseException as error:  # Raised below, on this thread.
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=run)
    longest, cpu, start = 0.0, time.thread_time(), time.perf_counter()
    last = start
    thread.start()
    while True:  # At least one interval, however fast the part.
        for _ in range(100):  # ~2 us of Python between clock reads.
            pass
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        if done.is_set():
            break
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    thread.join()
    if errors:
        raise errors[0]
    return 1000 * (wall - cpu), 1000 * longest


def _usage() -> tuple[float, int, float]:
    """The process's CPU seconds, its minor page faults and the machine's
    busy CPU seconds (NaN without `/proc/stat`)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    return r.ru_utime + r.ru_stime, r.ru_minflt, busy


def _model(layout: str, width: int = 1024):
    import keras
    import numpy as np

    import keras_dist as kd

    depth, batch = 8, 64  # Width 1024: checkpointing.py's 100mb, 96 MB.
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

    from keras_dist._checkpoint.freeze import freeze
    from keras_dist._checkpoint.pipeline import LocalSaves, OrbaxSaves

    state = list(model.variables) + list(model.optimizer.variables)
    store = OrbaxSaves(
        os.path.join(directory, "backup"),
        owner="BackupAndRestore",
        what="backup",
        async_save=False,
        max_to_keep=2,
    )
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
        store.save(model, next(count), meta={})

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else directory
    local_dir = tempfile.mkdtemp(prefix="keras_dist-local-", dir=shm)
    atexit.register(shutil.rmtree, local_dir, True)
    local = LocalSaves(local_dir, owner="bench")

    def local_backup():
        local.save(model, next(count), meta={})
        local.wait()

    def weights_h5():
        model.save_weights(os.path.join(directory, "m.weights.h5"))

    from keras_dist._checkpoint.keras_files import snapshot, write_snapshot

    frozen_h5 = snapshot(model, with_config=False)
    jax.block_until_ready([v for v in frozen_h5.values() if isinstance(v, jax.Array)])

    def weights_h5_background():
        path = os.path.join(directory, f"b{next(count)}.weights.h5")
        write_snapshot(frozen_h5, path)
        os.remove(path)

    return {
        "freeze": do_freeze,
        "raw_bytes": raw_bytes,
        "backup": backup,
        "local_backup": local_backup,
        "weights_h5": weights_h5,
        "weights_h5_background": weights_h5_background,
    }


def _fit_collections(model, layout, steps, collections, width) -> list:
    """Trains `steps` steps, an async backup every 2; collections by thread."""
    import numpy as np

    import keras_dist as kd

    rng = np.random.default_rng(1)
    x = rng.standard_normal((64 * steps, width), dtype=np.float32)
    y = rng.integers(0, 10, 64 * steps)
    collections.by_thread.clear()
    directory = tempfile.mkdtemp(prefix="kd-save-cost-fit-")
    try:
        backup = kd.callbacks.BackupAndRestore(directory, save_freq=2)
        start = time.perf_counter()
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[backup])
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return [
        {
            "layout": layout,
            "steps": steps,
            "saves": steps // 2,
            "fit_s": seconds,
            "thread": thread,
            "generation": generation,
            "collections": count,
            "gc_ms": 1000 * total,
            "longest_ms": 1000 * longest,
        }
        for (thread, generation), (count, total, longest) in sorted(
            collections.by_thread.items()
        )
    ]


def main():
    args = _parser().parse_args()
    force_host_devices(8)
    os.environ["KERAS_BACKEND"] = "jax"
    import jax

    collections = _Collections()
    rows, fit_rows = [], []
    for layout in args.layouts.split(","):
        model = _model(layout, args.width)
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
                    (cpu, faults, busy), start = _usage(), time.perf_counter()
                    gc_s, gc_n = collections.seconds, collections.count
                    parts[name]()
                    wall = time.perf_counter() - start
                    cpu2, faults2, busy2 = _usage()
                    samples.append(
                        (
                            1000 * (cpu2 - cpu),
                            1000 * wall,
                            faults2 - faults,
                            1000 * (collections.seconds - gc_s),
                            collections.count - gc_n,
                            1000 * (busy2 - busy),
                        )
                    )
                later = samples[1:] or samples
                stall_repeats = args.stall_repeats or args.repeats
                stalls = [_stall(parts[name]) for _ in range(stall_repeats)]
                row = {
                    "layout": layout,
                    "part": name,
                    "state_mb": state_mb,
                    "cpu_ms": statistics.median(s[0] for s in later),
                    "wall_ms": statistics.median(s[1] for s in later),
                    "faults": statistics.median(s[2] for s in later),
                    "machine_cpu_ms": statistics.median(s[5] for s in later),
                    "gc_ms": statistics.mean(s[3] for s in later),
                    "collections": statistics.mean(s[4] for s in later),
                    "first_cpu_ms": samples[0][0],
                    "stall_ms": statistics.median(s[0] for s in stalls),
                    "longest_stall_ms": statistics.median(s[1] for s in stalls),
                    "samples": samples,
                }
                row["cpu_ms_per_mb"] = row["cpu_ms"] / state_mb
                rows.append(row)
                print(
                    f"{layout} {name}: {row['cpu_ms']:.0f} ms CPU, "
                    f"{row['wall_ms']:.0f} ms wall, stalls a Python thread "
                    f"{row['stall_ms']:.0f} ms",
                    flush=True,
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if args.fit_steps:
            fit_rows += _fit_collections(
                model, layout, args.fit_steps, collections, args.width
            )
    import datetime

    payload = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine("cpu", len(jax.devices())),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "stall_repeats": args.stall_repeats or args.repeats,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "rows": rows,
        "fit_collections": fit_rows,
    }
    write_results(args.out, "save_cost", payload, markdown, lambda *_: False)


def markdown(payload: dict) -> str:
    out = [
        f"Measured {payload['date']} on {payload['machine']} "
        f"(`python benchmarks/{payload['command']}`): each part of a save "
        "timed alone, no training beside it; the median of "
        f"{payload['repeats'] - 1} repeats after a first (compiling, "
        "warming). CPU: the process's, every thread; machine CPU: the "
        "whole machine's busy time (`/proc/stat`, 10-ms ticks), the kernel's "
        "writeback threads included. Training thread "
        "stalled: the part run on a background thread beside a thread "
        "running Python without pause (a host-bound training loop), the "
        f"median over {payload.get('stall_repeats', payload['repeats'])} runs "
        "of the time that thread did "
        "not run (waiting for the GIL or a core); longest: its longest "
        "single stall. Garbage collector: "
        "the mean of its CPU time and collections in a call.",
        "",
        "| layout | part | state MB | CPU ms | CPU ms per MB | machine CPU ms "
        "| wall ms | minor page faults | garbage collector ms | collections "
        "| first call CPU ms | training thread stalled ms | longest stall ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        out.append(
            f"| {r['layout']} | {r['part']} | {r['state_mb']:.0f} | "
            f"{r['cpu_ms']:.0f} | {r['cpu_ms_per_mb']:.2f} | "
            f"{r.get('machine_cpu_ms', float('nan')):.0f} | {r['wall_ms']:.0f} | "
            f"{r['faults']:.0f} | {r['gc_ms']:.1f} | {r['collections']:.1f} | "
            f"{r['first_cpu_ms']:.0f} | {r.get('stall_ms', float('nan')):.0f} | "
            f"{r.get('longest_stall_ms', float('nan')):.1f} |"
        )
    fit_rows = payload.get("fit_collections") or []
    if fit_rows:
        first = fit_rows[0]
        out += [
            "",
            f"Then `fit`: {first['steps']} steps, an asynchronous "
            f"`BackupAndRestore` every 2 ({first['saves']} saves); Python's "
            "garbage collections by thread (the training thread; the others: "
            "keras_dist's writer, Orbax's) and generation (2: full).",
            "",
            "| layout | thread | generation | collections | CPU ms | longest ms |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in fit_rows:
            out.append(
                f"| {r['layout']} | {r['thread']} | {r['generation']} | "
                f"{r['collections']} | {r['gc_ms']:.1f} | {r['longest_ms']:.1f} |"
            )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
