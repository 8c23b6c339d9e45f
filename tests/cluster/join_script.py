"""Joins a cluster as `argv`: port, num_processes, process_id, timeout."""

import sys

import jax

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

port, count, process, timeout = sys.argv[1:5]
resolver = kd.cluster.SimpleClusterResolver(
    f"127.0.0.1:{port}", int(count), int(process)
)
kd.cluster.initialize(resolver, timeout=float(timeout))
print(f"joined {jax.process_index()} of {jax.process_count()}", flush=True)
