"""Resolvers read from the environment: SLURM, keras-dist-run, and auto-detection."""

import os
import re

from keras_dist.cluster._resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    parse_address,
)
from keras_dist.cluster._tf_config import TFConfigClusterResolver
from keras_dist.errors import ClusterConfigError

__all__ = ["SlurmClusterResolver", "resolve"]

DEFAULT_PORT = 12345
LAUNCHER_VARS = (
    "KERAS_DIST_COORDINATOR",
    "KERAS_DIST_NUM_PROCESSES",
    "KERAS_DIST_PROCESS_ID",
)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `"node[003-005,9],gpu1"` -> `"node003"`."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ClusterConfigError(f"Cannot read the SLURM node list {nodelist!r}.")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def SlurmClusterResolver(port: int | None = None) -> ClusterResolver:
    """The cluster of a SLURM job step: one process per task.

    Reads `SLURM_PROCID`, `SLURM_NTASKS` and the node list; the coordinator is
    the first node, on `port` (default `$KERAS_DIST_PORT` or 12345).

    Raises:
        ClusterConfigError: when not inside a SLURM job step or the values
            are inconsistent.
    """
    env = os.environ
    try:
        process_id = int(env["SLURM_PROCID"])
        num_processes = int(env.get("SLURM_NTASKS") or env["SLURM_NPROCS"])
    except KeyError as missing:
        raise ClusterConfigError(
            f"Not inside a SLURM job step: {missing.args[0]} is not set. Run the "
            "script with `srun`, or use another resolver."
        ) from None
    except ValueError:
        raise ClusterConfigError(
            "SLURM_PROCID / SLURM_NTASKS must be integers. Received: "
            f"SLURM_PROCID={env.get('SLURM_PROCID')!r}, "
            f"SLURM_NTASKS={env.get('SLURM_NTASKS')!r}."
        ) from None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ClusterConfigError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set.")
    port = int(env.get("KERAS_DIST_PORT", DEFAULT_PORT)) if port is None else port
    resolver = SimpleClusterResolver(
        f"{first_host(nodelist)}:{port}", num_processes, process_id
    )
    return ClusterResolver(**{**resolver.__dict__, "source": "SLURM"})


def _launcher_resolver() -> ClusterResolver:
    env = os.environ
    try:
        resolver = SimpleClusterResolver(
            env["KERAS_DIST_COORDINATOR"],
            int(env["KERAS_DIST_NUM_PROCESSES"]),
            int(env["KERAS_DIST_PROCESS_ID"]),
        )
    except (KeyError, ValueError) as error:
        raise ClusterConfigError(
            f"The keras-dist-run variables {LAUNCHER_VARS} are incomplete or not "
            f"integers ({error})."
        ) from None
    return ClusterResolver(**{**resolver.__dict__, "source": "keras-dist-run"})


def _jax_detected() -> bool:
    """Whether JAX's own cluster detection (TPU pods, k8s, ...) applies here."""
    try:
        from jax._src import clusters

        return any(
            env.is_env_present()
            for env in clusters.ClusterEnv._cluster_types
            if env.__name__ not in ("SlurmCluster", "MpiCluster")
        )
    except Exception:  # Private JAX API: absent means "not detected".
        return False


def resolve(resolver: ClusterResolver | None = None) -> ClusterResolver:
    """The cluster of this process: explicit > TF_CONFIG > SLURM > launcher > JAX > one.

    - an explicit `resolver` wins;
    - `TF_CONFIG` (tf.distribute);
    - a SLURM job step with more than one task;
    - the variables `keras-dist-run` sets;
    - JAX's own detection (Cloud TPU, GKE, ...): `source="jax"`, addresses
      left to `jax.distributed.initialize`;
    - otherwise a single process.
    """
    if resolver is not None:
        if not isinstance(resolver, ClusterResolver):
            raise TypeError(
                "`cluster_resolver` must be a keras_dist ClusterResolver (e.g. "
                "`kd.cluster.TFConfigClusterResolver()`). Received: "
                f"{type(resolver).__name__}."
            )
        return resolver
    env = os.environ
    if env.get("TF_CONFIG"):
        return TFConfigClusterResolver()
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return SlurmClusterResolver()
    if all(name in env for name in LAUNCHER_VARS):
        return _launcher_resolver()
    if _jax_detected():
        return ClusterResolver(None, 0, None, source="jax")
    return ClusterResolver(None, 1, 0, source="single process")


def check_address(resolver: ClusterResolver) -> None:
    if resolver.coordinator_address is not None:
        parse_address(resolver.coordinator_address, where="the coordinator address")
