"""Distributed values: `ReduceOp` and `PerReplica`."""

import enum
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from keras_dist.data._partial_batch import NumReal, real_rows_in
from keras_dist.strategies.devices._devices import device_name
from keras_dist.strategies.devices._mesh import BATCH_AXIS
from keras_dist.strategies.state import _ownership
from keras_dist.strategies.state._parts import StrategyParts

__all__ = ["PerReplica", "ReduceOp"]


class ReduceOp(enum.StrEnum):
    """How to combine the values of the replicas, as `tf.distribute.ReduceOp`.

    Example:

    ```python
    strategy.reduce(kd.ReduceOp.SUM, per_replica_losses, axis=None)
    strategy.reduce(kd.ReduceOp.MEAN, per_replica_losses, axis=0)
    strategy.reduce("mean", per_replica_losses, axis=0)  # the same
    ```
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def parse(cls, op: "ReduceOp | str", *, argument: str = "reduce_op") -> "ReduceOp":
        """`"sum"`, `"SUM"`, `ReduceOp.SUM` -> `ReduceOp.SUM`.

        Raises:
            ValueError: if `op` names no reduction.
        """
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(
            f'`{argument}` must be "sum" or "mean" (or kd.ReduceOp.SUM / '
            f"kd.ReduceOp.MEAN). Received: {argument}={op!r}."
        )


class PerReplica:
    """One value per replica, as returned by `Strategy.run` for values that vary.

    The values live stacked along a leading replica axis in one global
    `jax.Array` sharded over the mesh: replica `i`'s value is `stacked[i]`, on
    replica `i`'s device. Combine them with `strategy.reduce`,
    `strategy.gather` or `strategy.experimental_local_results`.

    When the batch `run` was given was padded (a partial last batch), the
    padded rows of per-example values are left out by `reduce` along axis 0,
    `gather` along axis 0 and `experimental_local_results`.

    Example:

    ```python
    def step(batch):
        return batch * 2.0  # differs by replica: a PerReplica

    per_replica = strategy.run(step, args=(dist_batch,))
    print(len(per_replica.values))  # strategy.num_replicas_in_sync
    total = strategy.reduce("sum", per_replica, axis=None)
    rows = strategy.gather(per_replica, axis=0)  # the real rows, in order
    ```

    Args:
        stacked: the values, with a leading axis of size `num_replicas`.
        num_real: the number of real rows of the global batch, if it was
            padded; else `None`.
        per_replica_batch: rows of the batch each replica received.
        strategy: the strategy whose `run` made the value, if known: another
            strategy's `run`, `reduce`, `gather` and
            `experimental_local_results` refuse it.
    """

    def __init__(
        self,
        stacked: jax.Array,
        *,
        num_real: int | None = None,
        per_replica_batch: int | None = None,
        strategy: Any = None,
    ):
        self.stacked = stacked
        self.num_real = num_real
        self.per_replica_batch = per_replica_batch
        self._strategy = strategy
        self._mesh = None if strategy is None else strategy.mesh

    @property
    def strategy(self) -> Any:
        """The strategy whose `run` made the value (None: not known)."""
        return self._strategy

    @property
    def mesh(self) -> "jax.sharding.Mesh | None":
        """The mesh of that strategy (None: not known)."""
        return self._mesh

    @property
    def num_replicas(self) -> int:
        return int(self.stacked.shape[0])

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """The value of every replica, in replica order (on the host's devices)."""
        return tuple(self.stacked[i] for i in range(self.num_replicas))

    def is_per_example(self) -> bool:
        """Whether axis 0 of each value runs over the replica's batch rows."""
        shape = self.stacked.shape
        return (
            self.per_replica_batch is not None
            and len(shape) > 1
            and shape[1] == self.per_replica_batch
        )

    def real_rows(self, replica: int) -> int:
        """How many leading rows of replica `replica`'s batch are real."""
        return real_rows(self.num_real, self.per_replica_batch, replica)

    def __repr__(self) -> str:
        shape = tuple(self.stacked.shape[1:])
        return (
            f"PerReplica(num_replicas={self.num_replicas}, shape={shape}, "
            f"dtype={self.stacked.dtype})"
        )


def real_rows(
    num_real: "NumReal | None", per_replica_batch: int | None, replica: int
) -> int:
    """Real rows of replica `replica` when the global batch has `num_real`."""
    b = per_replica_batch
    if num_real is None or b is None:
        return b if b is not None else 0
    # Padding sits at the end of each process's block, so a replica's real
    # rows are always its leading ones.
    return real_rows_in(num_real, replica * b, (replica + 1) * b)


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def concat_replicas(stacked: jax.Array, axis: int) -> jax.Array:
    """Concatenates `stacked[0], stacked[1], ...` along `axis` of each value."""
    moved = jnp.moveaxis(stacked, 0, axis)
    shape = list(moved.shape)
    merged = shape[axis] * shape[axis + 1]
    return moved.reshape(*shape[:axis], merged, *shape[axis + 2 :])


def foreign_mesh(
    strategy: StrategyParts, leaf: Any
) -> "jax.sharding.Mesh | jax.sharding.AbstractMesh | None":
    """The mesh of another strategy that `leaf` is split over, else None.

    `leaf` is another strategy's when it is a `PerReplica` made by the `run`
    of a strategy on other devices, or a `jax.Array` split along the axis
    `"batch"` of another mesh (a batch of another strategy's distributed
    dataset). Strategies on the same devices (equal meshes) count as one.
    """
    if isinstance(leaf, PerReplica):
        mesh = leaf.mesh
        own = strategy.mesh
        if mesh is None or mesh is own or mesh == own:
            return None
        return mesh
    if isinstance(leaf, jax.Array):
        return foreign_batch_mesh(strategy, leaf)
    return None


def foreign_batch_mesh(
    strategy: StrategyParts, array: jax.Array
) -> "jax.sharding.Mesh | jax.sharding.AbstractMesh | None":
    """`foreign_mesh` of a `jax.Array`.

    Runs on every array argument of every `run`: replicated weights (an empty
    spec) leave after three attribute reads.
    """
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    if len(spec) == 0:
        return None
    first = spec[0]
    if first != BATCH_AXIS and not (isinstance(first, tuple) and BATCH_AXIS in first):
        return None
    mesh = sharding.mesh
    own = strategy.mesh
    if mesh is own or mesh == own:
        return None
    return mesh


def other_strategy_error(
    strategy: StrategyParts,
    leaf: Any,
    mesh: "jax.sharding.Mesh | jax.sharding.AbstractMesh",
    *,
    call: str,
    argument: str,
    fix: str,
) -> ValueError:
    """The error for `leaf` (at `argument`), split over `mesh`, given to `call`."""
    other = leaf.strategy if isinstance(leaf, PerReplica) else None
    if other is None:
        # Several live strategies can share one mesh (jax interns equal
        # meshes): name the newest, the one that most likely split `leaf`.
        other = _ownership.newest_strategy_on(mesh)
    if other is None:
        names = ", ".join(device_name(d) for d in mesh.devices.flat)
        other = f"a mesh of other devices ([{names}])"
    if isinstance(leaf, PerReplica):
        what = f"a PerReplica value returned by the `run` of {other}"
        received = repr(leaf)
    else:
        what = f"a batch distributed by {other}"
        shape = ",".join(str(d) for d in leaf.shape)
        received = f"{leaf.dtype}[{shape}] split over {mesh.devices.size} replicas"
    return ValueError(
        f"`{argument}` of `{call}` is {what}, not by this strategy, "
        f"{strategy!r}: a value split over another strategy's devices is not "
        f"split over this one's replicas. Received: {argument}={received}. {fix}"
    )
