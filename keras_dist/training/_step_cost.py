"""`StepCost`: what one compiled step computes and communicates, read from XLA.

The numbers come from the program XLA compiled for one device (SPMD: every
device runs the same one): `cost_analysis()`'s floating-point operations,
and the collectives of the optimized HLO text with the bytes each one's
result holds on a device. The model's FLOPs per step are the device's times
the devices. `mfu` compares them with the devices' peak, from `PEAK_FLOPS`
(dense bf16 matrix units, the vendors' figures) or an argument.
"""

import dataclasses
import re
from typing import Any

import jax
import numpy as np

__all__ = ["PEAK_FLOPS", "StepCost", "peak_flops", "program_cost", "step_cost"]

# Peak dense bf16 FLOP/s of one JAX device, by `device_kind` prefix (lower
# case; the first match wins). TPU v2/v3 devices are cores (half a chip).
PEAK_FLOPS = {
    "tpu v2": 22.5e12,
    "tpu v3": 61.5e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu7x": 2307e12,
    "nvidia h200": 989e12,
    "nvidia h100": 989e12,
    "nvidia a100": 312e12,
    "nvidia l4": 121e12,
    "nvidia a10g": 125e12,
}

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
# `%name = f32[8,128]{1,0} all-reduce(`, or a tuple (XLA combines
# collectives) `(f32[2], ..., /*index=5*/f32[4]) all-reduce(`: no parentheses
# inside.
_OP = re.compile(
    r"=\s*(?P<shape>\([^()]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One compiled step, as XLA compiled it.

    Attributes:
        flops: floating-point operations of the model per step (all devices).
        device_flops: those of one device.
        devices: the devices the program runs on.
        collective_bytes: per collective kind (`"all-reduce"`, ...), the
            bytes its results hold on one device, per step.
        collectives: per kind, how many there are in the program.
        steps: steps per program (`steps_per_execution`); the figures above
            are per step (the program's loop body, counted once by XLA).
    """

    flops: float
    device_flops: float
    devices: int
    collective_bytes: dict[str, int]
    collectives: dict[str, int]
    steps: int = 1

    @property
    def communicated_bytes(self) -> int:
        """Bytes of every collective's results on one device, per step."""
        return sum(self.collective_bytes.values())

    def mfu(self, seconds_per_step: float, peak: float) -> float:
        """Model FLOPs utilization: achieved FLOP/s over the devices' peak.

        Args:
            seconds_per_step: the measured time of one step.
            peak: one device's peak FLOP/s (`peak_flops`).
        """
        return self.flops / (seconds_per_step * peak * self.devices)


def peak_flops(device: Any) -> float | None:
    """One device's peak dense bf16 FLOP/s from `PEAK_FLOPS`, or None."""
    kind = str(getattr(device, "device_kind", "")).lower()
    for prefix, value in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return value
    return None


def program_cost(compiled: Any, *, devices: int, steps: int = 1) -> StepCost:
    """The `StepCost` of a compiled JAX program (`jit(...).lower(...).compile()`).

    Args:
        compiled: a `jax.stages.Compiled`.
        devices: how many devices run it.
        steps: the steps one call runs (a `lax.scan` of one step: XLA
            counts its body once, so the figures stay one step's).
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # Older JAX: one dict per program.
        analysis = analysis[0] if analysis else {}
    # A fused group is a `lax.scan` of one step: XLA's cost analysis and its
    # text hold the loop's body once, so the figures are one step's already.
    device_flops = float((analysis or {}).get("flops", 0.0))
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for match in _OP.finditer(compiled.as_text()):
        op = match["op"]
        counts[op] = counts.get(op, 0) + 1
        sizes[op] = sizes.get(op, 0) + _bytes(match["shape"], op, bool(match["start"]))
    return StepCost(
        flops=device_flops * devices,
        device_flops=device_flops,
        devices=devices,
        collective_bytes=sizes,
        collectives=counts,
        steps=steps,
    )


def _bytes(shape: str, op: str, start: bool) -> int:
    arrays = [
        int(np.prod([int(d) for d in m["dims"].split(",") if d], dtype=np.int64))
        * _DTYPE_BYTES.get(m["dtype"], 4)
        for m in _ARRAY.finditer(shape)
    ]
    if start and op in ("all-gather", "collective-permute") and len(arrays) > 1:
        # An async start returns (operands..., results...): count the results.
        arrays = arrays[len(arrays) // 2 :]
    return sum(arrays)


def abstract(args: Any) -> Any:
    """`args` as `jax.ShapeDtypeStruct`s with their shardings (for `lower`)."""

    def one(leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        return leaf

    return jax.tree.map(one, args)


def step_cost(stats: Any, devices: int) -> StepCost | None:
    """The `StepCost` of the first compiled step a call ran (`StepStats.program`).

    Compiles it again from its arguments' shapes (XLA's cache makes that
    quick), once per call's stats; None if no compiled step ran.
    """
    if stats.cost is not None or stats.program is None:
        return stats.cost
    program, (args, kwargs), steps = stats.program
    stats.cost = program_cost(
        program.lower(*args, **kwargs).compile(), devices=devices, steps=steps
    )
    return stats.cost
