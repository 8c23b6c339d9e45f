"""Resolvers read from the environment: SLURM, keras-dist-run, and auto-detection."""

import contextlib
import dataclasses
import os
import pathlib
from typing import Any

import hostlist

from keras_dist._private_api import _jax_private
from keras_dist.cluster._resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    check_processes,
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


def tell_launcher(stage: str, process_id: int | None) -> None:
    """Tells keras-dist-run that this process is `stage` ("joining" its
    cluster, "joined"): a file in the folder it names in
    `KERAS_DIST_RUN_STATE`. It names a process that ends without joining
    while the others wait for it. Without the launcher: nothing."""
    folder = os.environ.get("KERAS_DIST_RUN_STATE")
    if folder and process_id is not None:
        with contextlib.suppress(OSError):
            pathlib.Path(folder, f"{stage}_{process_id}").touch()


def unjoined_cluster() -> ClusterResolver | None:
    """The cluster this process was started in (keras-dist-run, TF_CONFIG,
    SLURM) if it has several processes and this one has not joined it; else
    None (one process, joined, an evaluator, or a description that does not
    resolve: `initialize` reports that)."""
    if _jax_private.coordination_client() is not None:
        return None
    try:
        resolver = resolve()
    except Exception:  # A bad description: `initialize` says why.
        return None
    if resolver.num_processes > 1 and resolver.process_id is not None:
        return resolver
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `"node[003-005,9],gpu1"` -> `"node003"`.

    Read with python-hostlist (SLURM's own syntax, as `scontrol show hostnames`).

    Raises:
        ClusterConfigError: for a node list it cannot read (e.g. `node[1-3`).
    """
    try:
        hosts = hostlist.expand_hostlist(nodelist.strip())
    except hostlist.BadHostlist as error:
        hosts, reason = [], str(error)
    else:
        reason = "no host"
    if not hosts or any(not host or "[" in host or "]" in host for host in hosts):
        raise ClusterConfigError(
            f"Cannot read the SLURM node list ({reason}). Received: "
            f"{nodelist!r}. Expected SLURM's syntax, e.g. 'node[003-005,9],gpu1'; "
            "check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST."
        )
    return hosts[0]


# A SLURM job's coordinator port when none is given: JAX's own rule for
# SLURM (`jax._src.clusters.slurm_cluster`), so two jobs sharing a node do not
# meet on one port.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 61440, 4096


def port_from_environment(slurm_job: str | None = None) -> int:
    """`$KERAS_DIST_PORT`; else, for SLURM job `slurm_job`, a port derived
    from it (`61440 + job % 4096`, as JAX derives it); else 12345.

    Raises:
        ClusterConfigError: if `$KERAS_DIST_PORT` is not a port number in
            1..65535.
    """
    text = os.environ.get("KERAS_DIST_PORT", "").strip()
    if not text:
        if slurm_job is not None and slurm_job.isdigit():
            return SLURM_PORT_BASE + int(slurm_job) % SLURM_PORT_SPAN
        return DEFAULT_PORT
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ClusterConfigError(
            "KERAS_DIST_PORT must be a port number in 1..65535. Received: "
            f"KERAS_DIST_PORT={text!r}. Set it to a free port, e.g. "
            f"KERAS_DIST_PORT={DEFAULT_PORT}, or unset it."
        )
    return int(text)


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a SLURM job step: one process per task.

    Reads `SLURM_PROCID`, `SLURM_NTASKS` and the node list; the coordinator is
    the first node, on `port` (default `$KERAS_DIST_PORT`, else a port derived
    from `SLURM_JOB_ID` as JAX derives it: `61440 + job % 4096`, so jobs that
    share a node do not share a port). A
    `ClusterResolver` (so `isinstance` and `dataclasses.replace` work).

    Example:

    ```python
    # srun -N 2 -n 2 python train.py
    resolver = kd.cluster.SlurmClusterResolver(port=23456)
    strategy = kd.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    ```

    Args:
        port: the coordinator's port.
        **fields: `ClusterResolver` fields, taken as they are instead of
            reading the environment (as `dataclasses.replace` does).

    Raises:
        ClusterConfigError: when not inside a SLURM job step (e.g. in the
            batch script itself, not under `srun`), or the values are
            inconsistent or unreadable.
    """

    def __init__(self, port: int | None = None, **fields: Any) -> None:
        if "coordinator_address" not in fields:
            fields = _slurm_fields(port)
        super().__init__(**fields)


def _slurm_fields(port: int | None) -> dict:
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
    job = env.get("SLURM_JOB_ID")
    if job and "SLURM_STEP_ID" not in env and not env.get("SLURM_STEP_NODELIST"):
        raise ClusterConfigError(
            f"This process runs in SLURM job {job}'s batch script, not as one of "
            f"its {num_processes} tasks (SLURM_STEP_ID is not set): nothing else "
            "would join it. Start the tasks with `srun`, e.g. `srun python "
            "train.py` in the batch script (one process per task; srun sets "
            "each task's SLURM_PROCID)."
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ClusterConfigError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set.")
    port = port_from_environment(job) if port is None else port
    address = f"{first_host(nodelist)}:{port}"
    check_processes(address, num_processes, process_id)
    return {
        "coordinator_address": address,
        "num_processes": num_processes,
        "process_id": process_id,
        "task_id": process_id,
        "source": "SLURM",
    }


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
    return dataclasses.replace(resolver, source="keras-dist-run")


def _jax_detected() -> bool:
    """Whether JAX's own cluster detection (TPU pods, k8s, ...) applies here."""
    return _jax_private.jax_detects_cluster(excluding=("SlurmCluster", "MpiCluster"))


def resolve(resolver: ClusterResolver | None = None) -> ClusterResolver:
    """The cluster of this process: explicit > TF_CONFIG > SLURM > launcher > JAX > one.

    - an explicit `resolver` wins;
    - `TF_CONFIG` (tf.distribute);
    - a SLURM job step with more than one task;
    - the variables `keras-dist-run` sets;
    - JAX's own detection (Cloud TPU, GKE, ...): `source="jax"`, addresses
      left to `jax.distributed.initialize`;
    - otherwise a single process.

    Example:

    ```python
    resolver = kd.cluster.resolve()
    print(resolver.source)  # "TF_CONFIG", "SLURM", ..., "single process"
    ```
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
    if "SLURM_PROCID" in env and (env.get("SLURM_NTASKS") or "1").strip() != "1":
        # (A non-number SLURM_NTASKS is refused there, naming it.)
        return SlurmClusterResolver()
    if all(name in env for name in LAUNCHER_VARS):
        return _launcher_resolver()
    if _jax_detected():
        return ClusterResolver(None, 0, None, source="jax")
    return ClusterResolver(None, 1, 0, source="single process")


def check_address(resolver: ClusterResolver) -> None:
    if resolver.coordinator_address is not None:
        parse_address(resolver.coordinator_address, where="the coordinator address")
