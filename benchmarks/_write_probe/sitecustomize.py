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
TARGET = "keras_dist.callbacks._backup_store"


def _wrap(module):
    write = module.BackupStore._write

    def _write(self, number, state, meta):
        start, cpu, d2h = time.perf_counter(), time.thread_time(), 0.0
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
        }
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")

    module.BackupStore._write = _write


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET or not LOG:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


sys.meta_path.insert(0, _Hook())
