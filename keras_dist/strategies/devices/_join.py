"""Joining the JAX cluster, for the strategies that span processes.

`MultiWorkerMirroredStrategy` and `ParameterServerStrategy` resolve the
cluster (explicit resolver, TF_CONFIG, SLURM, `keras-dist-run`, JAX's own
detection), join it through `kd.cluster.initialize`, agree on one random seed
and lay their mesh over every device of every process.
"""

import random

import jax

from keras_dist._private_api import _access
from keras_dist.cluster import _initialize, _sync
from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.errors import ClusterConfigError

__all__ = ["agree_on_seed", "global_devices", "join_cluster"]


def join_cluster(
    cluster_resolver: ClusterResolver | None,
    *,
    timeout: float,
    implementation: str,
    strategy_name: str,
) -> ClusterResolver:
    """Resolves and joins the cluster; every process gets the same seed.

    Raises:
        ClusterConfigError: for a cluster with `ps` tasks: every host of a
            JAX cluster runs the same program as a worker.
        ClusterTimeoutError: if the cluster does not form within `timeout`.
    """
    resolver = _initialize.resolve(cluster_resolver)
    if resolver.has_parameter_servers:
        raise ClusterConfigError(
            f"{strategy_name} trains synchronously on workers only, but the "
            "cluster has `ps` (parameter server) tasks: "
            f'"ps": {resolver.cluster_spec["ps"]}. There are no parameter-server '
            "processes in JAX (every process runs the same program; sharded "
            'variables live on the workers\' devices): remove the "ps" entries '
            "from TF_CONFIG and run every host as a worker."
        )
    resolver = _initialize.initialize(
        resolver, timeout=timeout, implementation=implementation
    )
    _sync.set_timeout(timeout)
    agree_on_seed()
    return resolver


def global_devices() -> list[jax.Device]:
    """Every device of every process, process after process."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def agree_on_seed() -> None:
    """Gives every process the same random seed (Keras, NumPy, Python, TF).

    Initial weights, dropout seeds and shuffling must be the same on every
    process (tf.distribute broadcasts initial values for the same reason).
    If the program set a seed with `keras.utils.set_random_seed` the
    processes keep it (it is the same program); otherwise the chief picks one.
    """
    if jax.process_count() == 1 or _access.global_seed() is not None:
        return
    seed = _sync.broadcast_from_chief(
        "random-seed", random.SystemRandom().randrange(2**31)
    )
    # Keras's `set_random_seed`, TensorFlow's seed set only once the program
    # imports TensorFlow (not imported here: seconds, and its start-up lines).
    _access.set_random_seed(seed)
