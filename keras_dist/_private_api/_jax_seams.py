"""The private JAX names keras_dist uses, and the Keras hooks strategies override.

Both are checked by `seams()` (with the private Keras names of `_SEAMS`): a
JAX or Keras release that moves one fails at import with its name, instead
of in the middle of training. `jax` is pinned to the minor releases these
were checked against (pyproject.toml: 0.10 to 0.12).
"""

import importlib
from typing import Any

__all__ = ["CHECKED_JAX", "JAX_PRIVATE", "KERAS_HOOKS", "find"]

CHECKED_JAX = "0.10"

# (module, "Owner.name"): private JAX names `_jax_private.py` reads for the
# cluster layer, before any device starts. JAX has no public route to any:
# its coordination client (keras_dist's exchanges between processes, with
# timeouts), whether its backends started (a cluster must be joined first),
# and its own cluster detection without starting a device (TPU pods).
JAX_PRIVATE: tuple = (
    ("jax._src.distributed", "global_state"),  # coordination_client
    ("jax._src.xla_bridge", "_backends"),  # backends_started
    ("jax._src.clusters", "ClusterEnv._cluster_types"),  # jax_detects_cluster
    ("jax._src.clusters.cloud_tpu_cluster", "GkeTpuCluster.is_env_present"),
    ("jax._src.clusters.cloud_tpu_cluster", "GceTpuCluster.get_process_count"),
    ("jax._src.clusters.cloud_tpu_cluster", "GceTpuCluster.get_process_id"),
)

# (module, "Owner.name"): public Keras methods the strategies override
# (strategies/_base.py, _placement.py, _central_storage.py); Keras must
# still have, and call, them.
KERAS_HOOKS: tuple = (
    ("keras.distribution", "DataParallel.get_variable_layout"),
    ("keras.distribution", "DataParallel.scope"),
    ("keras.distribution", "DataParallel.num_processes"),
)

_ABSENT = object()


def _lookup(module_name: str, path: str) -> Any:
    try:
        owner: object = importlib.import_module(module_name)
    except ImportError:
        return _ABSENT
    for name in path.split("."):
        owner = getattr(owner, name, _ABSENT)
        if owner is _ABSENT:
            return _ABSENT
    return owner


def find(table: tuple) -> tuple[dict[str, Any], list[str]]:
    """`{"module.path": object}` of `table`, and the names that are missing."""
    found = {f"{module}.{path}": _lookup(module, path) for module, path in table}
    missing = [name for name, value in found.items() if value is _ABSENT]
    return {k: v for k, v in found.items() if v is not _ABSENT}, missing
