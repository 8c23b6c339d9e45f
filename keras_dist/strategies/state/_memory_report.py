"""`MemoryReport`: how many bytes of a model each device holds, and why."""

import dataclasses
from typing import Any

import jax
import numpy as np

from keras_dist.strategies.devices._mesh import BATCH_AXIS
from keras_dist.strategies.state._parts import StrategyParts

__all__ = ["MemoryReport", "VariableMemory", "memory_report"]

_DEVICE = "device"


@dataclasses.dataclass(frozen=True)
class VariableMemory:
    """One variable: its size, and how it is laid out on the mesh.

    Example:

    ```python
    report = strategy.memory_report(model)
    for v in report.variables:
        print(v.path, v.shape, v.parts, v.bytes_per_device, v.reason)
    ```

    Attributes:
        path: the Keras variable path (`"sequential/dense/kernel"`).
        kind: `"weight"` (the model's) or `"optimizer"` (slots, counters).
        shape: the global shape.
        dtype: the dtype name.
        nbytes: the bytes of the whole variable.
        bytes_per_device: the bytes the fullest device holds.
        axis: the dimension split over the mesh, `None` when replicated.
        parts: how many parts (1 when replicated).
        reason: why it is replicated (empty when sharded).
        memory_kind: the JAX memory kind of its buffers: `"device"`, or
            `"pinned_host"` for host memory (`CentralStorageStrategy`).
        spec: the mesh axis (or None) of each dimension, as its sharding's
            `PartitionSpec` says (on a 2-D mesh: `"batch"` and `"model"`).
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    bytes_per_device: int
    axis: int | None
    parts: int
    reason: str
    memory_kind: str = "device"
    spec: tuple = ()

    @property
    def layout(self) -> str:
        split = [(i, a) for i, a in enumerate(self.spec) if a is not None]
        if any(a != BATCH_AXIS for _, a in split) or len(split) > 1:
            axes = ", ".join(f"axis {i} over {a!r}" for i, a in split)
            return f"{axes} ({self.parts} parts): {self.reason}"
        if self.axis is None:
            return f"replicated: {self.reason}" if self.reason else "replicated"
        return f"axis {self.axis} in {self.parts}"


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of a model's weights and optimizer state.

    Example:

    ```python
    strategy = kd.MirroredStrategy(shard_variables=True)  # FSDP
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)  # builds the optimizer state
    report = strategy.memory_report(model)
    print(report.weight_bytes_per_device, report.optimizer_bytes_per_device)
    print(report)  # a table: each variable's bytes per device, and why
    ```

    Attributes:
        strategy: the strategy's `repr`.
        num_devices: devices in the mesh.
        weight_bytes: bytes of the weights (all of them, once).
        weight_bytes_per_device: bytes of weights in the device memory of the
            fullest device (weights kept in host memory are not counted).
        optimizer_bytes: bytes of the optimizer state (all of it, once).
        optimizer_bytes_per_device: bytes of optimizer state in the device
            memory of the fullest device.
        variables: one `VariableMemory` per variable, weights first.
        host_bytes_per_device: bytes of weights and optimizer state in the
            host memory space of the fullest device (`"pinned_host"`).
        host_bytes: bytes of weights and optimizer state in host memory, over
            every device's host memory space (a replicated variable counts
            once per device).
    """

    strategy: str
    num_devices: int
    weight_bytes: int
    weight_bytes_per_device: int
    optimizer_bytes: int
    optimizer_bytes_per_device: int
    variables: tuple[VariableMemory, ...]
    host_bytes_per_device: int = 0
    host_bytes: int = 0

    def __str__(self) -> str:
        header = ("variable", "shape", "dtype", "bytes", "per device", "memory")
        rows = [(*header, "layout")]
        rows += [
            (
                v.path,
                str(v.shape),
                v.dtype,
                str(v.nbytes),
                str(v.bytes_per_device),
                v.memory_kind,
                v.layout,
            )
            for v in self.variables
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            f"MemoryReport of {self.strategy}",
            f"  weights:         {self.weight_bytes_per_device} bytes per device "
            f"(of {self.weight_bytes})",
            f"  optimizer state: {self.optimizer_bytes_per_device} bytes per device "
            f"(of {self.optimizer_bytes})",
        ]
        if self.host_bytes:
            lines.append(
                f"  host memory:     {self.host_bytes_per_device} bytes per device "
                f"({self.host_bytes} in all)"
            )
        for row in rows:
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  " + "  ".join([*cells, row[-1]]))
        return "\n".join(lines)


def memory_report(strategy: StrategyParts, model: Any) -> MemoryReport:
    """Reads the layout and the device buffers of every variable of `model`."""
    weights = list(model.trainable_variables) + list(model.non_trainable_variables)
    optimizer = getattr(model, "optimizer", None)
    seen = {id(v) for v in weights}
    slots = [v for v in getattr(optimizer, "variables", []) if id(v) not in seen]
    entries: list[VariableMemory] = []
    # Bytes per device, by kind.
    per_device: dict[str, dict[jax.Device, int]] = {
        "weight": {},
        "optimizer": {},
        "host": {},
    }
    for kind, group in (("weight", weights), ("optimizer", slots)):
        for v in group:
            entries.append(_describe(strategy, v, kind, per_device))
    weight = [e for e in entries if e.kind == "weight"]
    opt = [e for e in entries if e.kind == "optimizer"]
    return MemoryReport(
        strategy=repr(strategy),
        num_devices=len(strategy.devices),
        weight_bytes=sum(e.nbytes for e in weight),
        weight_bytes_per_device=max(per_device["weight"].values(), default=0),
        optimizer_bytes=sum(e.nbytes for e in opt),
        optimizer_bytes_per_device=max(per_device["optimizer"].values(), default=0),
        variables=tuple(entries),
        host_bytes_per_device=max(per_device["host"].values(), default=0),
        host_bytes=sum(per_device["host"].values()),
    )


def _describe(
    strategy: StrategyParts,
    variable: Any,
    kind: str,
    per_device: dict[str, dict[jax.Device, int]],
) -> VariableMemory:
    """One variable's row; adds its bytes to `per_device[kind or "host"]`."""
    value = variable.value
    shape = tuple(int(d) for d in value.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * value.dtype.itemsize
    memory_kind = getattr(value.sharding, "memory_kind", None) or _DEVICE
    totals = per_device[kind if memory_kind == _DEVICE else "host"]
    held: dict = {}
    for shard in value.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    for device, n in held.items():
        totals[device] = totals.get(device, 0) + n
    spec = tuple(getattr(value.sharding, "spec", ()) or ())
    spec = spec + (None,) * (len(shape) - len(spec))
    axis = next((i for i, s in enumerate(spec) if s == BATCH_AXIS), None)
    reason = strategy.state_layout.reason(variable.path, shape, value.dtype)
    if strategy.model_parallel == 1:
        reason = "" if axis is not None else reason or "follows a replicated one"
    sizes = dict(strategy.mesh.shape)
    parts = 1
    for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            parts *= sizes.get(name, 1) if name is not None else 1
    return VariableMemory(
        path=variable.path,
        kind=kind,
        shape=shape,
        dtype=str(value.dtype),
        nbytes=nbytes,
        bytes_per_device=max(held.values(), default=0),
        axis=axis,
        parts=parts,
        reason=reason,
        memory_kind=memory_kind,
        spec=spec,
    )
