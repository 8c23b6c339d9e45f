"""A flood of eager 8-device programs, an all-reduce each (XLA:CPU's pool).

    python benchmarks/cpu_thread_flood.py STEPS

Prints `ok SECONDS`, or XLA aborts the process ("Expected 8 threads to join
the rendezvous"). Run several copies at once to load the cores, with
`PJRT_NPROC=8` (XLA's pool on a 2-core machine) and `PJRT_NPROC=24` (what
`import keras_dist` sets for 8 devices); benchmarks/README.md, "3 XLA:CPU
client threads a CPU device". JAX alone, no keras_dist: the pool is what
`PJRT_NPROC` says.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def main(steps: int) -> None:
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    everywhere = NamedSharding(mesh, PartitionSpec())
    x = jax.device_put(np.ones((64, 256), np.float32), rows)
    w = jax.device_put(np.ones((256, 256), np.float32), everywhere)
    start = time.perf_counter()
    for _ in range(steps):  # Eager: each op is a program of 8 devices.
        column_sums = jnp.sum(jnp.tanh(x @ w), axis=0)  # An all-reduce.
        w = w - 1e-6 * jnp.sqrt(jnp.abs(column_sums))[None, :]
    w.block_until_ready()
    print("ok", round(time.perf_counter() - start, 2), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
