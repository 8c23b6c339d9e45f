"""FSDP and ZeRO-1 for the data-parallel strategies: where their state goes.

`MirroredStrategy` and `MultiWorkerMirroredStrategy` take the same two
options, `shard_variables` (FSDP / ZeRO-3: weights and their optimizer slots
split over the mesh) and `shard_optimizer_state` (ZeRO-1: only the slots
split, the weights whole). This mixin holds both and answers the `Strategy`
hooks that decide a variable's and a slot's layout.
"""

from keras_dist.strategies._sharding import ShardPlan, plan_largest_divisible

__all__ = ["ShardedState"]


class ShardedState:
    """Mixin of a `Strategy`: the `shard_variables` / `shard_optimizer_state` options.

    A subclass calls `_set_sharded_state` before `Strategy.__init__`.
    """

    _shard_variables: bool = False
    _shard_optimizer_state: bool = False

    def _set_sharded_state(
        self, *, shard_variables: bool, shard_optimizer_state: bool
    ) -> None:
        for name, value in (
            ("shard_variables", shard_variables),
            ("shard_optimizer_state", shard_optimizer_state),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{name}` must be True or False. Received: {name}={value!r}."
                )
        self._shard_variables = shard_variables
        self._shard_optimizer_state = shard_optimizer_state

    @property
    def shard_variables(self) -> bool:
        """Whether variables are split over the devices (FSDP)."""
        return self._shard_variables

    @property
    def shard_optimizer_state(self) -> bool:
        """Whether optimizer slots are split over the devices (ZeRO-1)."""
        return self._shard_optimizer_state

    def _shards_state(self) -> bool:
        return self._shard_variables or self._shard_optimizer_state

    def _slots_need_whole_gradients(self) -> bool:
        return self._shard_optimizer_state and not self._shard_variables

    def _slot_layout(self, variable):
        if not self._shard_optimizer_state or self._shard_variables:
            return None  # Slots follow their variable.
        plan = plan_largest_divisible(tuple(variable.shape), self.num_replicas_in_sync)
        return plan.layout(variable.shape, self.device_mesh)

    def _shard_plan(self, shape: tuple[int, ...], dtype) -> ShardPlan:
        if not self._shard_variables:
            return super()._shard_plan(shape, dtype)
        return plan_largest_divisible(shape, self.num_replicas_in_sync)
