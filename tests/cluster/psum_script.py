"""A process of a keras-dist-run cluster: joins, then sums over all devices.

Env: KD_FAIL_RANK makes that rank raise an exception after joining;
KD_HANG_RANK makes that rank ignore SIGTERM and sleep (the launcher must
SIGKILL it); KD_LOOP_KILL_RANK makes every rank sum again and again, and
that rank SIGKILL itself after 3 sums (the others lose a peer).
"""

import os
import signal
import sys
import time

import numpy as np

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

resolver = kd.cluster.initialize(timeout=60)

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

rank = jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("batch",))
local = np.full((jax.local_device_count(),), rank + 1.0, dtype="float32")
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, PartitionSpec("batch")), local
)
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(
    x
)
print(
    f"rank {rank} of {jax.process_count()}: {jax.device_count()} devices, "
    f"sum {float(total):g}, chief {resolver.is_chief}, source {resolver.source}",
    flush=True,
)
if os.environ.get("KD_FAIL_RANK") == str(rank):
    raise RuntimeError("failing on purpose")
if os.environ.get("KD_HANG_RANK") == str(rank):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
if os.environ.get("KD_FAIL_RANK") or os.environ.get("KD_HANG_RANK"):
    time.sleep(600)  # The healthy ranks wait; the launcher must stop them.
if os.environ.get("KD_LOOP_KILL_RANK"):
    total_of = jax.jit(
        lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec())
    )
    for i in range(600):
        float(total_of(x))
        if i == 3 and os.environ["KD_LOOP_KILL_RANK"] == str(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)
