"""Times each background Orbax write of `BackupAndRestore` (see README.md)."""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

if os.environ.get("KD_SWITCH"):
    sys.setswitchinterval(float(os.environ["KD_SWITCH"]))
LOG = os.environ.get("KD_LOG")
STEPS_LOG = os.environ.get("KD_STEPS_LOG")
TARGET = "keras_dist.callbacks._backup_store"
CALLBACKS = "keras.src.callbacks.callback_list"
STEP_TIMES: list = []
WRITES: list = []


def _wrap(module):
    write = module.BackupStore._write

    def _write(self, number, state, meta):
        start, cpu, d2h = time.perf_counter(), time.thread_time(), 0.0
        WRITES.append(start)
        if os.environ.get("KD_PREHOST"):
            import numpy as np

            state = {k: [np.asarray(v) for v in vs] for k, vs in state.items()}
            d2h = time.perf_counter() - start
        write(self, number, state, meta)
        record = {
            "wall": time.perf_counter() - start,
            "cpu": time.thread_time() - cpu,
            "d2h": d2h,
            "switch": sys.getswitchinterval(),
            "start": start,
        }
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")

    module.BackupStore._write = _write


def _wrap_callbacks(module):
    """Times each step's begin on the training thread (`KD_STEPS_LOG`)."""
    begin = module.CallbackList.on_train_batch_begin

    def on_train_batch_begin(self, batch, logs=None):
        STEP_TIMES.append(time.perf_counter())
        return begin(self, batch, logs)

    module.CallbackList.on_train_batch_begin = on_train_batch_begin

    import atexit

    def dump():
        with open(STEPS_LOG, "w") as f:
            json.dump({"steps": STEP_TIMES, "writes": WRITES}, f)

    atexit.register(dump)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, name, wrap):
        self.name, self.wrap = name, wrap

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            self.wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if LOG:
    sys.meta_path.insert(0, _Hook(TARGET, _wrap))
if STEPS_LOG:
    sys.meta_path.insert(0, _Hook(CALLBACKS, _wrap_callbacks))
