"""Where a variable's bytes live: whole on every device, or split over the mesh.

A strategy's mesh has one axis, `"batch"`, of N devices. A `NamedSharding`
splits one dimension over a whole mesh axis, so a sharded variable is split
into exactly N parts, along its largest dimension divisible by N (the first
such one on a tie). Every other variable is replicated, and a `ShardPlan`
says why, for `memory_report`.

Keras creates each variable with the layout `Strategy.get_variable_layout`
returns; optimizer slots are created with their model variable's layout
(`BaseOptimizer.add_variable_from_reference(..., layout=reference._layout)`),
so they are split exactly like the weight they belong to.
"""

import dataclasses
from collections.abc import Callable, Sequence

import keras

from keras_dist.strategies.devices._mesh import BATCH_AXIS

__all__ = ["ShardPlan", "plan_by_partitioner", "plan_largest_divisible", "replicated"]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The decision for one variable: `axis` split in `parts`, or replicated.

    Attributes:
        axis: the dimension split over the mesh, or `None` when replicated.
        parts: how many parts (the mesh size when sharded, else 1).
        reason: why the variable is replicated (empty when sharded).
    """

    axis: int | None
    parts: int = 1
    reason: str = ""

    def layout(
        self, shape: Sequence[int], device_mesh
    ) -> keras.distribution.TensorLayout:
        axes: list[str | None] = [None] * len(shape)
        if self.axis is not None:
            axes[self.axis] = BATCH_AXIS
        return keras.distribution.TensorLayout(axes, device_mesh)


def replicated(reason: str) -> ShardPlan:
    return ShardPlan(axis=None, parts=1, reason=reason)


def plan_largest_divisible(shape: Sequence[int], num_parts: int) -> ShardPlan:
    """Splits the largest dimension divisible by `num_parts`, if any."""
    shape = tuple(int(d) for d in shape)
    if num_parts < 2:
        return replicated("one device")
    if not shape:
        return replicated("scalar")
    divisible = [i for i, d in enumerate(shape) if d % num_parts == 0]
    if not divisible:
        return replicated(f"no dimension divisible by {num_parts}")
    axis = max(divisible, key=lambda i: (shape[i], -i))
    return ShardPlan(axis=axis, parts=num_parts)


def plan_by_partitioner(
    partitioner: Callable | None, shape: Sequence[int], dtype, num_parts: int
) -> ShardPlan:
    """Shards over the whole mesh when `partitioner` asks for >= 2 shards."""
    if partitioner is None:
        return replicated("no variable_partitioner")
    shape = tuple(int(d) for d in shape)
    if not shape:
        return replicated("scalar")
    shards = max(partitioner(shape, dtype))
    if shards < 2:
        return replicated(f"{_name(partitioner)} asks for 1 shard")
    return plan_largest_divisible(shape, num_parts)


def _name(partitioner) -> str:
    return getattr(type(partitioner), "__name__", "the partitioner")
