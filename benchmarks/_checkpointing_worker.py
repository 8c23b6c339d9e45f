"""One checkpointing configuration in a fresh process (`checkpointing.py`).

    python benchmarks/_checkpointing_worker.py CONFIG SIZE LAYOUT STEPS EVERY DIR \
        [PAIRS [PAGE_CACHE_PAUSE]]

Trains an MLP with Adam (`SIZE`: its state, weights + Adam's two slots, of
~100 MB or ~1 GB) under `LAYOUT` (`fsdp`: MirroredStrategy(shard_variables=
True); `mirrored`), one warm-up `fit` of `EVERY` steps (compilation), then
one timed `fit` of `STEPS` steps with the configuration's callback saving
every `EVERY` steps into `DIR`. Prints `RESULT {json}`: ms/step, the
process's CPU time per step (every thread: what saving costs the host), the
seconds the training thread spent in each save (`blocked_s`), its own CPU
seconds in each (`blocked_cpu_s`) and, of
those, waiting for the previous save to finish (`waited_s`: keras_dist's
callbacks only; a save that reads a value of the state on the host also
waits there for the steps already dispatched), the wait for saves in
flight at the end of `fit`, the device -> host copy time of the whole
state (the limit of any save that snapshots it), the peak RSS above the
RSS before the timed `fit`, and the machine's floor for writing the state
through the page cache: into pages freed seconds earlier (`page_cache_s`)
and right after (`page_cache_reused_s`).

With `PAIRS` > 0 (a saving configuration) it then times `PAIRS` more pairs
of `fit`s in this process, one without a checkpoint callback and one with a
new one saving into a new directory, alternating: each from its first batch's
begin to its end (before the wait for the last write), every hook inside.
`paired_added_ms_per_save`: the median of the saving `fit`s less the
median of the others, per save: the time a save adds, with no difference
between processes in it (`paired_nosave_ms`, `paired_save_ms`).
"""

import os
import resource
import shutil
import statistics
import sys
import threading
import time

from _runs import force_host_devices, print_result

CONFIG, SIZE, LAYOUT = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, EVERY, DIRECTORY = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
PAIRS = int(sys.argv[7]) if len(sys.argv) > 7 else 0
PAGE_CACHE_PAUSE = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
# Under keras-dist-run (`--processes 2`): its XLA_FLAGS give 4 devices each.
PLATFORM = force_host_devices(8)
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402

# (width, hidden layers, batch): ~8.5 M and ~85 M parameters; `tiny` for
# the smoke test of the benchmark's schema (tests/test_checkpoint_benchmarks.py).
SIZES = {"100mb": (1024, 8, 64), "1gb": (3072, 9, 32), "tiny": (64, 2, 16)}
WIDTH, DEPTH, BATCH = SIZES[SIZE]


class RSSPeak:
    """Peak resident memory of this process, sampled every 2 ms."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def release_free_memory() -> None:
    """Collects garbage and hands the allocator's free pages back (glibc), so
    the RSS growth that follows counts new allocations, not reused ones."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # Not glibc: RSS as is.
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# Within a save: the seconds it waited for the previous save to finish.
_SAVE = {"inside": False, "waited": 0.0, "depth": 0}
WAITED: list = []


BLOCKED_CPU: list = []


def _timed(obj, name: str, record: list, save: bool = False) -> None:
    """Records the seconds each call of `obj.name` takes (a save's block),
    and for a save the training thread's own CPU seconds in it (the rest of
    its block is waiting: for a core, a lock, or the previous save)."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        if save:
            _SAVE.update(inside=True, waited=0.0)
        try:
            return method(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)
            if save:
                BLOCKED_CPU.append(time.thread_time() - cpu)
                WAITED.append(_SAVE["waited"])
                _SAVE["inside"] = False

    setattr(obj, name, timed)


def _count_waits() -> None:
    """Times keras_dist's waits for a save in flight (outermost call only)."""
    from keras_dist._checkpoint import pipeline

    for cls in (pipeline.Writer,):
        method = cls.wait

        def wait(self, *args, _method=method, **kwargs):
            start = time.perf_counter()
            _SAVE["depth"] += 1
            try:
                return _method(self, *args, **kwargs)
            finally:
                _SAVE["depth"] -= 1
                if _SAVE["inside"] and _SAVE["depth"] == 0:
                    _SAVE["waited"] += time.perf_counter() - start

        cls.wait = wait


class _Window(keras.callbacks.Callback):
    """A `fit` from its first batch's begin to its end (first in the list:
    before the checkpoint callback's wait for its last write)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0 and not hasattr(self, "start"):
            self.start = time.perf_counter()

    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start


def callback(blocked: list, directory: str = DIRECTORY):
    """The configuration's checkpoint callback, its save entry point timed."""
    path = os.path.join(directory, "ckpt")
    if CONFIG == "nosave":
        return None
    if CONFIG in ("bar_sync", "bar_async"):
        cb = kd.callbacks.BackupAndRestore(
            path,
            save_freq=EVERY,
            delete_checkpoint=False,
            async_save=CONFIG == "bar_async",
        )
        _timed(cb, "_save", blocked, save=True)
    elif CONFIG in ("mc_sync", "mc_async", "mc_sharded"):
        sharded = CONFIG == "mc_sharded"
        cb = kd.callbacks.ModelCheckpoint(
            path if sharded else path + "_{batch}.weights.h5",
            save_weights_only=not sharded,
            save_freq=EVERY,
            async_save=CONFIG != "mc_sync",
            sharded=sharded,
            max_to_keep=2,
        )
        _timed(cb, "_save_model", blocked, save=True)
    elif CONFIG == "floor":
        cb = _Floor(path)
        _timed(cb, "_save", blocked, save=True)
    elif CONFIG == "keras_orbax":
        cb = keras.callbacks.OrbaxCheckpoint(
            path, save_freq=EVERY, save_on_background=True, max_to_keep=2
        )
        _timed(cb, "_save_checkpoint", blocked, save=True)
    else:
        raise SystemExit(f"unknown configuration {CONFIG!r}")
    return cb


class _Floor(keras.callbacks.Callback):
    """The floor of an asynchronous save, for comparison (no format, no
    library): keras_dist's snapshot on the devices, as its callbacks take
    it, then on a background thread each distinct part's bytes written to a
    new file (each process its own) and the previous file deleted; one
    write in flight."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.batches, self.previous = path, 0, None
        self.thread: threading.Thread | None = None
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def _state(self) -> list:
        return [v.value for v in self.model.variables + self.model.optimizer.variables]

    def on_train_begin(self, logs=None):
        from keras_dist._checkpoint.freeze import prepare

        prepare(self._state())  # Compiled now, as the callbacks do.

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches % EVERY == 0:
            self._save()

    def _save(self) -> None:
        from keras_dist._checkpoint.freeze import freeze

        self.on_train_end()  # One write in flight.
        frozen = freeze(self._state())
        path = f"{self.path}_{jax.process_index()}_{self.batches}.bin"
        self.thread = threading.Thread(target=self._write, args=(frozen, path))
        self.thread.start()

    def _write(self, frozen: list, path: str) -> None:
        with open(path, "wb") as f:
            for value in frozen:
                for part in _local_parts(value):
                    f.write(memoryview(np.ascontiguousarray(part)))
        if self.previous:
            os.remove(self.previous)
        self.previous = path

    def on_train_end(self, logs=None):
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _process_cpu_seconds() -> float:
    """This process's CPU time, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _local_parts(value) -> list:
    """This process's distinct parts of `value` (one per index: a replicated
    value once)."""
    parts = {}
    for shard in value.addressable_shards:
        parts.setdefault(str(shard.index), shard.data)
    return list(parts.values())


def host_copy_seconds(model) -> float:
    """Device -> host copy of the state this process holds (the whole state
    with one process): every copy started, then awaited."""
    best = float("inf")
    for _ in range(3):
        values = [v.value for v in model.variables + model.optimizer.variables]
        parts = [p for v in values for p in _local_parts(v)]
        start = time.perf_counter()
        for part in parts:
            part.copy_to_host_async()
        _ = [np.array(part, copy=True) for part in parts]
        best = min(best, time.perf_counter() - start)
    return best


def page_cache_write_seconds(nbytes: int, pause: float) -> dict:
    """This machine's floor for writing `nbytes` (the state) through the page
    cache, as every writer (h5py, Orbax) does: a new file written `pause`
    seconds after the previous one was deleted (saves are seconds apart),
    and one written right after (the median of 3 each). On a machine whose memory
    stays resident the two are alike; a VM that hands freed pages back to
    its host (virtio-balloon free-page reporting) backs every page again,
    and the first is several times the second."""
    chunk = memoryview(bytearray(4 << 20))
    path = os.path.join(DIRECTORY, f"page-cache-probe-{jax.process_index()}")

    def write() -> float:
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(0, nbytes, len(chunk)):
                f.write(chunk)
        seconds = time.perf_counter() - start
        os.remove(path)
        return seconds

    write()
    fresh, reused = [], []
    for _ in range(3):
        time.sleep(pause)
        fresh.append(write())
        reused.append(write())
    return {
        "page_cache_s": statistics.median(fresh),
        "page_cache_reused_s": statistics.median(reused),
    }


def make_strategy() -> kd.Strategy:
    """MirroredStrategy; MultiWorkerMirroredStrategy under keras-dist-run."""
    shard = LAYOUT == "fsdp"
    if "KERAS_DIST_PROCESS_ID" in os.environ:
        return kd.MultiWorkerMirroredStrategy(shard_variables=shard)
    return kd.MirroredStrategy(jax.devices(), shard_variables=shard)


def main():
    strategy = make_strategy()
    devices = jax.devices()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        layers = [keras.Input((WIDTH,))]
        layers += [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
        layers += [keras.layers.Dense(10)]
        model = keras.Sequential(layers)
        model.compile(
            keras.optimizers.Adam(1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rows = BATCH * (STEPS + EVERY)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
    y = rng.integers(0, 10, rows)
    model.fit(x[: BATCH * EVERY], y[: BATCH * EVERY], batch_size=BATCH, verbose=0)
    blocked: list = []
    _count_waits()
    cb = callback(blocked)
    ends: list = []
    if cb is not None:
        _timed(cb, "on_train_end", ends)
    release_free_memory()  # The warm-up's freed memory: not counted twice.
    rss_before = RSSPeak.now()
    with RSSPeak() as rss:
        start, cpu = time.perf_counter(), _process_cpu_seconds()
        history = model.fit(
            x[BATCH * EVERY :],
            y[BATCH * EVERY :],
            batch_size=BATCH,
            verbose=0,
            shuffle=False,
            callbacks=[cb] if cb is not None else [],
        )
        seconds = time.perf_counter() - start
        cpu = _process_cpu_seconds() - cpu
    blocked_cpu, waited = list(BLOCKED_CPU), list(WAITED)  # The timed fit's.
    paired = _pairs(model, x[BATCH * EVERY :], y[BATCH * EVERY :])
    state = sum(v.value.nbytes for v in model.variables + model.optimizer.variables)
    page_cache = (
        page_cache_write_seconds(state, PAGE_CACHE_PAUSE) if PAGE_CACHE_PAUSE else {}
    )
    print_result(
        {
            "config": CONFIG,
            "size": SIZE,
            "layout": LAYOUT,
            "platform": PLATFORM,
            "devices": len(devices),
            "processes": jax.process_count(),
            "rank": jax.process_index(),
            "params": int(model.count_params()),
            "state_mb": state / 2**20,
            "steps": STEPS,
            "every": EVERY,
            "ms_per_step": [1000 * seconds / STEPS],
            # The steps alone: the wait at the end of `fit` for the last
            # save's write (`end_wait_s`) left out.
            "steps_ms_per_step": 1000 * (seconds - sum(ends)) / STEPS,
            "saves": len(blocked),
            "host_cpu_ms_per_step": [1000 * cpu / STEPS],
            "blocked_s": blocked,
            "blocked_cpu_s": blocked_cpu,
            "waited_s": waited,
            "end_wait_s": sum(ends),
            "host_copy_s": host_copy_seconds(model),
            **page_cache,
            "peak_rss_mb": rss.peak / 2**20,
            "extra_rss_mb": max(0, rss.peak - rss_before) / 2**20,
            "first_epoch_s": 0.0,
            "final_loss": float(history.history["loss"][-1]),
            **paired,
        }
    )


def _pairs(model, x, y) -> dict:
    """`PAIRS` pairs of timed `fit`s, without and with saving (see above)."""
    if PAIRS <= 0 or CONFIG == "nosave":
        return {}
    times: dict = {"nosave": [], "save": []}
    saves = []
    for i in range(PAIRS):
        for kind in ("nosave", "save"):
            window, blocked = _Window(), []
            callbacks = [window]
            if kind == "save":
                directory = os.path.join(DIRECTORY, f"pair{i}")
                callbacks.append(callback(blocked, directory))
            model.fit(
                x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=callbacks
            )
            times[kind].append(window.seconds)
            if kind == "save":
                saves.append(len(blocked))
                shutil.rmtree(directory, ignore_errors=True)
    added = statistics.median(times["save"]) - statistics.median(times["nosave"])
    return {
        "paired_nosave_ms": [1000 * t / STEPS for t in times["nosave"]],
        "paired_save_ms": [1000 * t / STEPS for t in times["save"]],
        "paired_added_ms_per_save": 1000 * added / max(statistics.median(saves), 1),
    }


if __name__ == "__main__":
    main()
