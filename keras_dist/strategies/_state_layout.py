"""`StateLayout`: where a strategy puts variables and optimizer state.

The `Strategy` hooks Keras and keras_dist's seams ask when a variable is
created (`get_variable_layout`), when an optimizer slot is created
(`_slot_layout`), and around each step when the state lives outside device
memory (`_state_to_compute` / `_state_to_storage`); `memory_report` reads the
result. Subclasses override the hooks (FSDP/ZeRO-1, partitioners, host
memory).
"""

from typing import Any

import jax
import keras

from keras_dist.cluster import _sync
from keras_dist.errors import ProcessMismatchError
from keras_dist.strategies._memory_report import MemoryReport, memory_report
from keras_dist.strategies._sharding import ShardPlan, replicated

__all__ = ["StateLayout"]


class StateLayout:
    """Mixin of `Strategy`: replicated state by default; subclasses split it.

    Needs `device_mesh`, `_replicated` and `_spans_processes` (set by
    `Strategy.__init__`).
    """

    def get_variable_layout(self, variable):
        """Keras's hook: the layout each new variable is created with.

        Replicated unless the strategy shards (`_shard_plan`). With several
        processes, each new variable is first checked to have the same shape
        and dtype on every process: JAX would otherwise abort in a collective
        when the processes build different models.
        """
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        if self._spans_processes:
            _check_same_variable(variable)
        plan = self._shard_plan(tuple(variable.shape), variable.dtype)
        return plan.layout(variable.shape, self.device_mesh)

    def _shard_plan(self, shape: tuple[int, ...], dtype) -> ShardPlan:
        """Where a variable of `shape` and `dtype` goes; a strategy may shard."""
        del shape, dtype
        return replicated(f"{type(self).__name__} replicates variables")

    def _slot_layout(self, variable):
        """The layout of an optimizer slot of `variable`; None: the variable's."""
        del variable
        return None

    def _slots_need_whole_gradients(self) -> bool:
        """Whether slots are split while weights are whole (ZeRO-1)."""
        return False

    def _replicated_constraint(self, array):
        """`array` laid out whole on every device (inside a compiled step)."""
        return jax.lax.with_sharding_constraint(array, self._replicated)

    def _state_off_device(self) -> bool:
        """Whether variables live outside device memory (host memory).

        Then every step, compiled or eager, gets its state through
        `_state_to_compute` and an eager step gives it back through
        `_state_to_storage` (a compiled one through its `out_shardings`).
        """
        return False

    def _state_to_compute(self, state: Any) -> Any:
        """A step's state (variables' values) moved where the step computes."""
        return state

    def _state_to_storage(self, state: Any) -> Any:
        """A step's new state moved where the variables live."""
        return state

    def memory_report(self, model: keras.Model) -> MemoryReport:
        """Bytes of `model`'s weights and optimizer state per device, and why.

        Example:

        ```python
        print(strategy.memory_report(model))   # a table, one row per variable
        ```

        Returns:
            A `MemoryReport`: totals per device and, for each variable, its
            layout (split axis and parts, or replicated and the reason),
            measured on the arrays' device buffers.
        """
        return memory_report(self, model)


def _check_same_variable(variable) -> None:
    mine = [variable.path, list(variable.shape), str(variable.dtype)]
    everyone = _sync.allgather("variable", mine)
    if all(other[1:] == mine[1:] for other in everyone):
        return
    found = "; ".join(
        f"process {p}: {path!r} of shape {tuple(shape)} and dtype {dtype}"
        for p, (path, shape, dtype) in enumerate(everyone)
    )
    raise ProcessMismatchError(
        f"The processes create different variables ({found}). With several "
        "processes every process must run the same program and build the same "
        "model in `strategy.scope()`."
    )
