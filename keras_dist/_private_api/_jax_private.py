"""The private JAX reads of the cluster layer, behind public names.

JAX has no public API for these (listed in `_jax_seams.JAX_PRIVATE`, checked
at import): whether its backends started (a cluster must be joined before),
its coordination client (keras_dist's exchanges between processes), and its
own cluster detection, read without starting a device (a TPU pod must join
its cluster before JAX touches one). Imports nothing of keras_dist: any
layer may call these.
"""

from typing import Any

__all__ = [
    "backends_started",
    "cloud_tpu_hosts",
    "coordination_client",
    "jax_detects_cluster",
]


def backends_started() -> bool:
    """Whether JAX has started its backends (it then knows the cluster, if any)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:
        return False


def coordination_client() -> Any:
    """The client `jax.distributed.initialize` started, or None."""
    from jax._src import distributed

    return distributed.global_state.client


def jax_detects_cluster(*, excluding: tuple[str, ...]) -> bool:
    """Whether one of JAX's own cluster environments (TPU pods, k8s, ...) but
    those named in `excluding` is present."""
    try:
        from jax._src import clusters

        return any(
            env.is_env_present()
            for env in clusters.ClusterEnv._cluster_types
            if env.__name__ not in excluding
        )
    except Exception:  # Private JAX API: absent means "not detected".
        return False


def cloud_tpu_hosts() -> tuple[int, int | None] | None:
    """`(hosts, this host's index)` of a Cloud TPU slice or pod, else None.

    Read as `jax.distributed.initialize()` reads it (the TPU VM's metadata
    server, or the GKE variables), without starting the TPU.
    """
    try:
        from jax._src.clusters import cloud_tpu_cluster

        for env in (cloud_tpu_cluster.GkeTpuCluster, cloud_tpu_cluster.GceTpuCluster):
            if env.is_env_present():
                return env.get_process_count(), env.get_process_id()
    except Exception:  # Private JAX API, or no metadata server: not a pod.
        return None
    return None
