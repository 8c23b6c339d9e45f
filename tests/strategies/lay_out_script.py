"""One of 2 processes of one CPU device each, joined by plain JAX.

    python lay_out_script.py PORT RANK OUT_JSON

Records whether `jax.device_put` of an array of this process to a sharding
over both processes gives a well-formed array (its local pieces one device
each), and what keras_dist's `lay_out` gives for the same values.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

port, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=2, process_id=rank, initialization_timeout=60
)
from keras_dist.strategies.devices._lay_out import lay_out  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("b",))


def pieces(array) -> list:
    """How many devices each local piece of `array` claims (1 when well-formed)."""
    return [len(piece.devices()) for piece in array._arrays]


def local_values(array) -> list:
    return [np.asarray(shard.data).tolist() for shard in array.addressable_shards]


value = jnp.arange(12.0).reshape(4, 3)
result = {"device_put": pieces(jax.device_put(value, NamedSharding(mesh, P())))}
for name, spec in (("replicated", P()), ("split", P("b"))):
    laid = lay_out(value, NamedSharding(mesh, spec))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(laid)
    result[name] = {
        "pieces": pieces(laid),
        "local": local_values(laid),
        "sum": float(np.asarray(total.addressable_shards[0].data)),
    }
with open(out, "w") as f:
    json.dump(result, f)
