"""`TPUClusterResolver`: the TPU of this VM (and of its pod), for `TPUStrategy`."""

import warnings
from collections.abc import Sequence
from typing import Any

from keras_dist.cluster import _initialize
from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.cluster._tpu_devices import cloud_tpu_hosts, visible_tpu_devices

__all__ = ["TPUClusterResolver", "joined"]

_LOCAL = (None, "", "local")
# tf's arguments that address a TPU Node or a GCP API; JAX uses the TPU of
# the VM it runs on (and on a pod, the hosts it detects itself).
_DEFAULTS = {
    "zone": None,
    "project": None,
    "job_name": "worker",
    "coordinator_name": None,
    "coordinator_address": None,
    "credentials": "default",
    "service": None,
    "discovery_url": None,
}


class TPUClusterResolver:
    """This VM's TPU, as `tf.distribute.cluster_resolver.TPUClusterResolver`.

    Finds the TPU devices JAX sees; on a pod slice (several TPU VM hosts,
    detected the way `jax.distributed.initialize()` detects Cloud TPU) it
    counts the hosts without starting the TPU, so that `TPUStrategy` can
    join them first. Without a TPU it raises `ValueError`, like tf, so the
    tutorials' fallback works unchanged (the example below).

    The arguments are tf's. `tpu=None`, `""` or `"local"` mean this VM's
    TPU; a TPU name or gRPC address (TPU Nodes, which JAX does not use) and
    the GCP arguments are accepted with one warning naming them: run the
    program on the TPU VM itself (every host of a pod).

    Example:

    ```python
    try:
        resolver = kd.cluster.TPUClusterResolver()
        strategy = kd.TPUStrategy(resolver)
    except ValueError:  # no TPU here
        strategy = kd.MirroredStrategy()
    ```

    Args:
        tpu: `None`, `""` or `"local"`; other values are ignored (warned).
        zone: accepted for tf compatibility and ignored (warned when not
            tf's default), as are the next seven.
        project: as `zone`.
        job_name: as `zone`.
        coordinator_name: as `zone`.
        coordinator_address: as `zone`.
        credentials: as `zone`.
        service: as `zone`.
        discovery_url: as `zone`.
        devices: keyword-only: the TPU devices to use instead of
            `jax.devices("tpu")` — objects with the attributes of a TPU
            `jax.Device` (`id`, `platform`, `device_kind`, `coords`,
            `core_on_chip`, `process_index`, `slice_index`). Tests describe
            a TPU with it. Defaults to `None`.

    Raises:
        keras_dist.errors.TPUNotFoundError: (a `ValueError`) if JAX sees no
            TPU, naming the platform found and the fix.
        TypeError: if `tpu` is not a string.
    """

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        credentials: Any = "default",
        service: Any = None,
        discovery_url: str | None = None,
        *,
        devices: Sequence[Any] | None = None,
    ):
        if tpu is not None and not isinstance(tpu, str):
            raise TypeError(
                '`tpu` must be a string: None, "" or "local" for the TPU of this '
                f"VM. Received: tpu={tpu!r} of type {type(tpu).__name__}."
            )
        given = dict(
            zone=zone,
            project=project,
            job_name=job_name,
            coordinator_name=coordinator_name,
            coordinator_address=coordinator_address,
            credentials=credentials,
            service=service,
            discovery_url=discovery_url,
        )
        _warn_ignored(tpu, given)
        self._tpu = tpu
        self._devices, self._num_hosts, self._process_id = _discover(tpu, devices)

    @staticmethod
    def connect(
        tpu: str | None = None, zone: str | None = None, project: str | None = None
    ) -> "TPUClusterResolver":
        """Finds the TPU and joins its hosts, as tf's `TPUClusterResolver.connect()`.

        The same as `TPUClusterResolver(tpu, zone, project)` followed by
        `join_cluster()` (tf: `experimental_connect_to_cluster` and
        `initialize_tpu_system`).

        Raises:
            keras_dist.errors.TPUNotFoundError: (a `ValueError`) without a TPU.
        """
        resolver = TPUClusterResolver(tpu, zone, project)
        resolver.join_cluster()
        return resolver

    @property
    def tpu(self) -> str | None:
        """The `tpu` argument, as given."""
        return self._tpu

    @property
    def num_hosts(self) -> int:
        """TPU VM hosts (JAX processes) the TPU spans: 1 except on a pod slice."""
        return self._num_hosts

    @property
    def devices(self) -> tuple:
        """Every TPU device of the cluster (all hosts), in JAX's order.

        Raises:
            RuntimeError: on a pod whose hosts have not joined yet
                (`join_cluster()`, which `TPUStrategy` calls).
        """
        if self._devices is None:
            raise RuntimeError(
                f"The TPU spans {self._num_hosts} hosts, whose JAX processes must "
                "join one cluster before JAX can list the devices. Call "
                "`resolver.join_cluster()` first (`kd.TPUStrategy(resolver)` and "
                "`kd.tpu.initialize_tpu_system(resolver)` do)."
            )
        return self._devices

    def join_cluster(self, *, timeout: float = 300.0) -> None:
        """Joins the hosts of a pod into one JAX cluster (once); else does nothing.

        Every host must run the same program: the call waits up to `timeout`
        seconds for all of them (`kd.cluster.initialize`, JAX detecting the
        coordinator from the TPU VM metadata).

        Raises:
            keras_dist.errors.ClusterTimeoutError: if a host does not arrive.
            RuntimeError: if JAX already started the TPU in this process.
            keras_dist.errors.TPUNotFoundError: if the joined cluster has no TPU.
        """
        if self._devices is not None:
            return
        _initialize.initialize(
            ClusterResolver(None, self._num_hosts, self._process_id, source="jax"),
            timeout=timeout,
        )
        self._devices = visible_tpu_devices(tpu=self._tpu)

    def master(self) -> str:
        """`"local"`: JAX runs on the TPU of this VM (tf gives a TPU Node address)."""
        return "local"

    def __repr__(self) -> str:
        found = "" if self._devices is None else f", num_devices={len(self._devices)}"
        return (
            f"TPUClusterResolver(tpu={self._tpu!r}, num_hosts={self._num_hosts}{found})"
        )


def joined(
    resolver: TPUClusterResolver | None, *, argument: str, example: str
) -> TPUClusterResolver:
    """`resolver` (a new one if `None`) with its pod joined: `devices` is readable.

    Args:
        resolver: what the user passed.
        argument: its parameter name, for the error.
        example: the corrected call, for the error.

    Raises:
        TypeError: if `resolver` is not a `TPUClusterResolver` (e.g. tf's).
        keras_dist.errors.TPUNotFoundError: (a `ValueError`) without a TPU.
    """
    if resolver is None:
        resolver = TPUClusterResolver()
    if not isinstance(resolver, TPUClusterResolver):
        raise TypeError(
            f"`{argument}` must be a `kd.cluster.TPUClusterResolver` (tf's own "
            f"resolver cannot drive JAX). Received: {type(resolver).__name__}. "
            f"Use {example}."
        )
    resolver.join_cluster()
    return resolver


def _discover(tpu: str | None, devices: Sequence[Any] | None) -> tuple:
    """`(devices, hosts, this host's index)`; devices `None` on a pod not joined
    yet: JAX must not start the TPU before `jax.distributed.initialize`."""
    if devices is not None:
        devices = _checked(devices)
    elif not _initialize.backend_started():  # Else JAX already knows the hosts.
        pod = cloud_tpu_hosts()
        if pod is not None and pod[0] > 1:
            return None, *pod
    if devices is None:
        devices = visible_tpu_devices(tpu=tpu)
    return devices, len({d.process_index for d in devices}), None


def _warn_ignored(tpu: str | None, given: dict) -> None:
    ignored = {k: v for k, v in given.items() if v != _DEFAULTS[k]}
    if tpu not in _LOCAL:
        ignored = {"tpu": tpu, **ignored}
    if not ignored:
        return
    names = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
    warnings.warn(
        f"TPUClusterResolver ignores {names}: JAX uses the TPU attached to the VM "
        "it runs on (TPU Nodes reached by name or gRPC address are not "
        "supported). Run the program on the TPU VM itself — on a pod, on every "
        "host (gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...) — "
        "and create the resolver with no arguments.",
        UserWarning,
        stacklevel=3,
    )


def _checked(devices: Sequence[Any]) -> tuple:
    devices = tuple(devices)
    platforms = sorted({str(getattr(d, "platform", "?")) for d in devices})
    if platforms != ["tpu"]:
        raise ValueError(
            "`devices` must be a non-empty list of TPU devices (platform 'tpu'). "
            f"Received: devices of platforms {platforms}. Leave `devices=None` to "
            "use every TPU device JAX sees, or use `kd.MirroredStrategy(devices)` "
            "for other devices."
        )
    return devices
