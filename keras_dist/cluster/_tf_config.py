"""`TFConfigClusterResolver`: the TF_CONFIG environment variable of tf.distribute."""

import json
import os
from typing import Any

from keras_dist.cluster._resolver import ClusterResolver, parse_address
from keras_dist.errors import ClusterConfigError

__all__ = ["TFConfigClusterResolver"]

ROLES = ("chief", "worker", "evaluator", "ps")


class TFConfigClusterResolver(ClusterResolver):
    """Reads a tf.distribute cluster from TF_CONFIG.

    ```
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}'
    ```

    The JAX processes are the `chief` (if any) followed by the `worker`s; the
    chief — the `chief` task, else `worker` 0 — is process 0 and its address
    is the coordinator. A `ClusterResolver` (so `isinstance` and
    `dataclasses.replace` work). An `evaluator` is outside the training cluster
    (`process_id=None`); `ps` tasks are listed but take no process.

    Example:

    ```python
    resolver = kd.cluster.TFConfigClusterResolver()  # reads $TF_CONFIG
    print(resolver.task_type, resolver.task_id, resolver.process_id)
    strategy = kd.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    ```

    Args:
        task_type: overrides `task.type`.
        task_id: overrides `task.index`.
        tf_config: the JSON text or dict; defaults to `$TF_CONFIG`.
        **fields: other `ClusterResolver` fields; given together with
            `coordinator_address` (as `dataclasses.replace` does), they are
            taken as they are instead of reading TF_CONFIG.

    Raises:
        ClusterConfigError: for invalid JSON, a missing `cluster` or `task`,
            an unknown task type, an index out of range, a bad or duplicate
            address — quoting the offending part.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        *,
        tf_config: "str | dict | None" = None,
        **fields: Any,
    ) -> None:
        if "coordinator_address" not in fields:
            fields = _resolve(task_type, task_id, tf_config)
        else:
            fields.update(task_type=task_type, task_id=task_id)
        super().__init__(**fields)


def _resolve(
    task_type: str | None, task_id: int | None, tf_config: "str | dict | None"
) -> dict:
    """The `ClusterResolver` fields TF_CONFIG describes."""
    config = _load(tf_config)
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterConfigError(
            'TF_CONFIG needs a non-empty "cluster" object, e.g. '
            '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, ...}. '
            f"Received: {json.dumps(config)[:300]}."
        )
    spec = _cluster_spec(cluster)
    task = config.get("task")
    if task_type is None or task_id is None:
        if not isinstance(task, dict):
            raise ClusterConfigError(
                'TF_CONFIG needs a "task" object naming this process, e.g. '
                '"task": {"type": "worker", "index": 0}. Received: '
                f"task={json.dumps(task)}."
            )
        task_type = task.get("type") if task_type is None else task_type
        task_id = task.get("index", 0) if task_id is None else task_id
    if task_type not in spec:
        raise ClusterConfigError(
            f"TF_CONFIG task type {task_type!r} is not in the cluster, whose "
            f"task types are {sorted(spec)}. Received: task={json.dumps(task)}."
        )
    if (
        isinstance(task_id, bool)
        or not isinstance(task_id, int)
        or not (0 <= task_id < len(spec[task_type]))
    ):
        raise ClusterConfigError(
            f"TF_CONFIG task index {task_id!r} is out of range: the cluster has "
            f"{len(spec[task_type])} {task_type!r} task(s) "
            f"{spec[task_type]}. Received: task={json.dumps(task)}."
        )
    training = [("chief", i) for i in range(len(spec.get("chief", [])))] + [
        ("worker", i) for i in range(len(spec.get("worker", [])))
    ]
    if not training:
        raise ClusterConfigError(
            'TF_CONFIG\'s cluster has no "chief" or "worker" task to train on. '
            f"Received: cluster={json.dumps(cluster)}."
        )
    first_type, first_id = training[0]
    process_id = (
        training.index((task_type, task_id))
        if (task_type, task_id) in training
        else None
    )
    return {
        "coordinator_address": spec[first_type][first_id],
        "num_processes": len(training),
        "process_id": process_id,
        "task_type": task_type,
        "task_id": task_id,
        "source": "TF_CONFIG",
        "cluster_spec": spec,
    }


def _load(tf_config: "str | dict | None") -> dict:
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if tf_config is None:
            raise ClusterConfigError("TF_CONFIG is not set in the environment.")
    if isinstance(tf_config, dict):
        return tf_config
    try:
        config = json.loads(tf_config)
    except json.JSONDecodeError as error:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({error.msg} at character {error.pos}). "
            f"Received: {tf_config[:300]!r}."
        ) from None
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object. Received: {tf_config[:300]!r}."
        )
    return config


def _cluster_spec(cluster: dict) -> dict[str, list[str]]:
    spec: dict[str, list[str]] = {}
    seen: dict[tuple[str, int], str] = {}
    for role, addresses in cluster.items():
        if role not in ROLES:
            raise ClusterConfigError(
                f"TF_CONFIG cluster has an unknown task type {role!r}; known types "
                f"are {list(ROLES)}. Received: {json.dumps({role: addresses})}."
            )
        if isinstance(addresses, str):
            addresses = [addresses]
        if not isinstance(addresses, list) or not addresses:
            raise ClusterConfigError(
                f"TF_CONFIG cluster[{role!r}] must be a non-empty list of "
                f'"host:port". Received: {json.dumps(addresses)}.'
            )
        for index, address in enumerate(addresses):
            where = f"TF_CONFIG cluster[{role!r}][{index}]"
            host, port = parse_address(address, where=where)
            key = (host, port)
            if key in seen:
                raise ClusterConfigError(
                    f"TF_CONFIG lists the address {address!r} twice: as {seen[key]} "
                    f"and as {role}:{index}. Every task needs its own host:port."
                )
            seen[key] = f"{role}:{index}"
        spec[role] = list(addresses)
    return spec
