"""Distributed values: `ReduceOp` and `PerReplica`."""

import enum
from typing import Any

import jax
import jax.numpy as jnp

from keras_dist.data._partial_batch import NumReal, real_rows_in

__all__ = ["PerReplica", "ReduceOp"]


class ReduceOp(enum.StrEnum):
    """How to combine the values of the replicas, as `tf.distribute.ReduceOp`."""

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

    Args:
        stacked: the values, with a leading axis of size `num_replicas`.
        num_real: the number of real rows of the global batch, if it was
            padded; else `None`.
        per_replica_batch: rows of the batch each replica received.
    """

    def __init__(
        self,
        stacked: jax.Array,
        *,
        num_real: int | None = None,
        per_replica_batch: int | None = None,
    ):
        self.stacked = stacked
        self.num_real = num_real
        self.per_replica_batch = per_replica_batch

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
