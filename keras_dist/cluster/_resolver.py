"""`ClusterResolver`: who is in the JAX cluster, and who am I."""

import dataclasses
import re
from typing import Any

from keras_dist._checks import check_int
from keras_dist.errors import ClusterConfigError

__all__ = [
    "ClusterResolver",
    "SimpleClusterResolver",
    "check_processes",
    "parse_address",
]

_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[^:]+)$")


def parse_address(address: Any, *, where: str) -> tuple[str, int]:
    """`"host:port"` -> `(host, port)`; errors quote `where` and the address.

    Raises:
        ClusterConfigError: if `address` is not `host:port` with a port in 1..65535.
    """
    if not isinstance(address, str):
        raise ClusterConfigError(
            f'{where} must be a "host:port" string. Received: {address!r}.'
        )
    match = _ADDRESS.match(address.strip())
    if not match:
        raise ClusterConfigError(
            f'{where} must be "host:port", e.g. "10.0.0.1:12345". Received: '
            f"{address!r}."
        )
    port = match["port"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(
            f"{where} has a port that is not a number in 1..65535: {port!r} in "
            f"{address!r}."
        )
    return match["host"], int(port)


@dataclasses.dataclass(frozen=True)
class ClusterResolver:
    """A resolved cluster: the JAX processes and this process's place in it.

    Example:

    ```python
    resolver = kd.cluster.resolve()  # TF_CONFIG, SLURM, keras-dist-run, ...
    print(resolver.source, resolver.num_processes, resolver.process_id)
    if resolver.task_type == "evaluator":
        ...  # outside the training cluster: run a SidecarEvaluator
    ```

    Attributes:
        coordinator_address: `"host:port"` of process 0, where JAX's
            coordination service listens.
        num_processes: JAX processes taking part in training.
        process_id: this process's index, `0 ... num_processes - 1`, or `None`
            for a process outside training (a TF_CONFIG `evaluator`).
        task_type: the role, as tf.distribute names it (`"worker"`, `"chief"`,
            `"evaluator"`, `"ps"`).
        task_id: the index within the role.
        source: where this came from (`"TF_CONFIG"`, `"SLURM"`, ...).
        cluster_spec: role -> list of addresses, when known.
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int | None
    task_type: str = "worker"
    task_id: int = 0
    source: str = "explicit"
    cluster_spec: dict = dataclasses.field(default_factory=dict)

    @property
    def is_chief(self) -> bool:
        """The process that writes files and prints: process 0."""
        return self.process_id == 0

    @property
    def has_parameter_servers(self) -> bool:
        return bool(self.cluster_spec.get("ps"))

    def describe(self) -> str:
        return (
            f"process {self.process_id} of {self.num_processes} "
            f"({self.task_type}:{self.task_id}, from {self.source}), coordinator "
            f"{self.coordinator_address}"
        )


def check_processes(
    coordinator_address: Any, num_processes: Any, process_id: Any
) -> None:
    """Refuses a bad address, process count or process index.

    Raises:
        ClusterConfigError: naming the argument and the value received.
    """
    parse_address(coordinator_address, where="`coordinator_address`")
    check_int(num_processes, name="num_processes", error=ClusterConfigError)
    if (
        isinstance(process_id, bool)
        or not isinstance(process_id, int)
        or not (0 <= process_id < num_processes)
    ):
        raise ClusterConfigError(
            f"`process_id` must be in [0, {num_processes}). Received: "
            f"process_id={process_id!r}."
        )


class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly, like tf.distribute's `SimpleClusterResolver`.

    A `ClusterResolver` (so `isinstance` and `dataclasses.replace` work).

    Example:

    ```python
    resolver = kd.cluster.SimpleClusterResolver(
        "10.0.0.1:12345", num_processes=2, process_id=int(os.environ["RANK"])
    )
    strategy = kd.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    ```

    Args:
        coordinator_address: `"host:port"` of process 0.
        num_processes: number of processes (>= 1).
        process_id: this process's index in `0 ... num_processes - 1`.
        **fields: other `ClusterResolver` fields (`dataclasses.replace`).

    Raises:
        ClusterConfigError: for a bad address, count or index.
    """

    def __init__(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        **fields: Any,
    ) -> None:
        check_processes(coordinator_address, num_processes, process_id)
        fields = {"task_id": process_id, "source": "explicit", **fields}
        super().__init__(coordinator_address, num_processes, process_id, **fields)
