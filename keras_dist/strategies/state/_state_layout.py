"""`StateLayout`: where a strategy keeps variables and optimizer state.

A collaborator of every `Strategy` (`strategy.state_layout`), not a mixin:
Keras's hook `get_variable_layout` asks it where each new variable goes; the
seams ask it where an optimizer slot goes (`slot_layout`), and, around each
step, whether the state lives outside device memory and how to move it
(`off_device`, `to_compute`, `to_storage`); `memory_report` reads the plans.

- `StateLayout`: everything replicated (MirroredStrategy, TPUStrategy, ...).
- `ShardedStateLayout`: FSDP (`shard_variables`) and ZeRO-1
  (`shard_optimizer_state`) over the mesh.
- `PartitionedStateLayout`: a tf `variable_partitioner`
  (ParameterServerStrategy).
- `HostMemoryStateLayout`: replicated in host memory (CentralStorageStrategy).
"""

from collections.abc import Callable
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.strategies.state import _host_memory
from keras_dist.strategies.state._sharding import (
    ShardPlan,
    plan_by_partitioner,
    plan_largest_divisible,
    replicated,
)

__all__ = [
    "SHARD_OPTIMIZER_STATE",
    "SHARD_VARIABLES",
    "HostMemoryStateLayout",
    "PartitionedStateLayout",
    "ShardedStateLayout",
    "StateLayout",
]


class StateLayout:
    """Every variable and optimizer slot replicated on every device.

    Args:
        device_mesh: the strategy's `keras.distribution.DeviceMesh`.
        owner: the strategy's name, for the reasons `memory_report` gives.
    """

    def __init__(self, device_mesh: keras.distribution.DeviceMesh, owner: str):
        self.device_mesh = device_mesh
        self.owner = owner
        self.replicated = NamedSharding(device_mesh.backend_mesh, PartitionSpec())

    @property
    def num_replicas(self) -> int:
        """Replicas: the size of the mesh's first axis, `"batch"`."""
        return int(self.device_mesh.devices.shape[0])

    def shard_plan(self, shape: tuple[int, ...], dtype: Any) -> ShardPlan:
        """Where a variable of `shape` and `dtype` goes."""
        del shape, dtype
        return replicated(f"{self.owner} replicates variables")

    def reason(self, path: str, shape: tuple[int, ...], dtype: Any) -> str:
        """Why the variable at `path` is laid out as it is (`memory_report`)."""
        del path
        return self.shard_plan(shape, dtype).reason

    def variable_layout(self, variable: Any) -> keras.distribution.TensorLayout:
        """The layout a new variable is created with."""
        plan = self.shard_plan(tuple(variable.shape), variable.dtype)
        return plan.layout(variable.shape, self.device_mesh)

    def slot_layout(self, variable: Any) -> "keras.distribution.TensorLayout | None":
        """The layout of an optimizer slot of `variable`; None: the variable's."""
        del variable
        return None

    @property
    def splits_state(self) -> bool:
        """Whether some variables or optimizer slots are split over the mesh."""
        return False

    @property
    def slots_need_whole_gradients(self) -> bool:
        """Whether slots are split while weights are whole (ZeRO-1)."""
        return False

    def replicated_constraint(self, array: Any) -> Any:
        """`array` laid out whole on every device (inside a compiled step)."""
        return jax.lax.with_sharding_constraint(array, self.replicated)

    @property
    def off_device(self) -> bool:
        """Whether variables live outside device memory (host memory).

        Then every step, compiled or eager, gets its state through
        `to_compute` and an eager step gives it back through `to_storage` (a
        compiled one through its `out_shardings`).
        """
        return False

    def to_compute(self, state: Any) -> Any:
        """A step's state (variables' values) moved where the step computes."""
        return state

    def to_storage(self, state: Any) -> Any:
        """A step's new state moved where the variables live."""
        return state

    def take_warnings(self, stacklevel: int = 2) -> None:
        """Warns once about what the layouts of new variables could not do.

        Args:
            stacklevel: the frame the warning names, counted from the caller
                of `take_warnings` (1), as `warnings.warn` counts.
        """


def sharded_option(name: str, doc: str) -> property:
    """A strategy's read-only view of one option of its `ShardedStateLayout`."""

    def option(strategy: Any) -> bool:
        return bool(getattr(strategy.state_layout, name))

    return property(option, doc=doc)


# The two options of MirroredStrategy, MultiWorkerMirroredStrategy and
# TPUStrategy.
SHARD_VARIABLES = sharded_option(
    "shard_variables", "Whether variables are split over the devices (FSDP)."
)
SHARD_OPTIMIZER_STATE = sharded_option(
    "shard_optimizer_state",
    "Whether optimizer slots are split over the devices (ZeRO-1).",
)


class ShardedStateLayout(StateLayout):
    """FSDP (`shard_variables`) and ZeRO-1 (`shard_optimizer_state`).

    A split variable or slot is split along its largest dimension divisible
    by the number of replicas; one with none stays replicated.
    """

    def __init__(
        self,
        device_mesh: keras.distribution.DeviceMesh,
        owner: str,
        *,
        shard_variables: bool,
        shard_optimizer_state: bool,
    ):
        super().__init__(device_mesh, owner)
        self.shard_variables = shard_variables
        self.shard_optimizer_state = shard_optimizer_state

    def shard_plan(self, shape: tuple[int, ...], dtype: Any) -> ShardPlan:
        if not self.shard_variables:
            return super().shard_plan(shape, dtype)
        return plan_largest_divisible(shape, self.num_replicas)

    def slot_layout(self, variable: Any) -> "keras.distribution.TensorLayout | None":
        if not self.shard_optimizer_state or self.shard_variables:
            return None  # Slots follow their variable.
        plan = plan_largest_divisible(tuple(variable.shape), self.num_replicas)
        return plan.layout(variable.shape, self.device_mesh)

    @property
    def splits_state(self) -> bool:
        return self.shard_variables or self.shard_optimizer_state

    @property
    def slots_need_whole_gradients(self) -> bool:
        return self.shard_optimizer_state and not self.shard_variables


class PartitionedStateLayout(StateLayout):
    """Variables split as a tf `variable_partitioner` says (None: replicated)."""

    def __init__(
        self,
        device_mesh: keras.distribution.DeviceMesh,
        owner: str,
        *,
        partitioner: Callable | None,
    ):
        super().__init__(device_mesh, owner)
        self.partitioner = partitioner

    def shard_plan(self, shape: tuple[int, ...], dtype: Any) -> ShardPlan:
        return plan_by_partitioner(self.partitioner, shape, dtype, self.num_replicas)

    @property
    def splits_state(self) -> bool:
        return self.partitioner is not None


class HostMemoryStateLayout(StateLayout):
    """Replicated, in a memory of the devices (`"pinned_host"`, or `"device"`)."""

    def __init__(
        self,
        device_mesh: keras.distribution.DeviceMesh,
        owner: str,
        *,
        memory_kind: str,
    ):
        super().__init__(device_mesh, owner)
        self.memory_kind = memory_kind
        self.storage = NamedSharding(
            device_mesh.backend_mesh, PartitionSpec(), memory_kind=memory_kind
        )

    def shard_plan(self, shape: tuple[int, ...], dtype: Any) -> ShardPlan:
        del shape, dtype
        if self.memory_kind == _host_memory.DEVICE:
            return replicated(f"{self.owner}: on the compute device")
        return replicated(f"{self.owner}: whole in host memory")

    def variable_layout(self, variable: Any) -> keras.distribution.TensorLayout:
        layout = super().variable_layout(variable)
        if self.memory_kind == _host_memory.DEVICE:
            return layout
        return _host_memory.MemoryLayout(
            layout.axes, layout.device_mesh, memory_kind=self.memory_kind
        )

    @property
    def off_device(self) -> bool:
        return self.memory_kind != _host_memory.DEVICE

    def to_compute(self, state: Any) -> Any:
        return _host_memory.move(state, self.replicated)

    def to_storage(self, state: Any) -> Any:
        return _host_memory.move(state, self.storage)
