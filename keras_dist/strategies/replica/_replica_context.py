"""`ReplicaContext` and `get_replica_context`: the view from inside `run`."""

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_dist.data._partial_batch import NumReal, real_mask, total_real
from keras_dist.strategies.replica._values import ReduceOp
from keras_dist.strategies.state import _ownership
from keras_dist.strategies.state._parts import StrategyParts

__all__ = ["ReplicaContext", "get_replica_context"]

AXIS = "batch"
_CURRENT: contextvars.ContextVar["ReplicaContext | None"] = contextvars.ContextVar(
    "keras_dist_replica_context", default=None
)


class ReplicaContext:
    """What a function run by `strategy.run` sees: its replica and collectives.

    Like `tf.distribute.ReplicaContext`. Obtain it with
    `kd.get_replica_context()` inside the function given to `strategy.run`.

    Example:

    ```python
    def step(batch):
        ctx = kd.get_replica_context()  # a ReplicaContext inside run
        local = batch.sum()
        total = ctx.all_reduce("sum", local)  # the same on every replica
        return ctx.replica_id_in_sync_group, total

    ids, totals = strategy.run(step, args=(dist_batch,))
    ```

    Args:
        strategy: the strategy running the replicas.
        per_replica_batch: rows of the batch each replica received, if a
            batch was passed to `run`.
        num_real: real rows of the global batch when it was padded, else None.
    """

    def __init__(
        self,
        strategy: StrategyParts,
        *,
        per_replica_batch: int | None = None,
        num_real: NumReal | None = None,
    ):
        # None in the default context (`_DefaultReplicaContext`).
        self.strategy: StrategyParts | None = strategy
        self.per_replica_batch = per_replica_batch
        self.num_real = num_real
        self._in_run = True

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas taking part in the collectives."""
        if self.strategy is None:  # The default context overrides this.
            raise RuntimeError("This replica context has no strategy.")
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index, `0 ... num_replicas_in_sync - 1` (traced)."""
        return jax.lax.axis_index(AXIS)

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any) -> Any:
        """Sums or averages `value` (a pytree of arrays) over all replicas.

        Note: gradients of replicated weights (`jax.grad` with respect to
        arguments every replica received whole) are already summed over the
        replicas — JAX adds the all-reduce to the backward pass, as
        tf.distribute's `apply_gradients` did. Summing them again multiplies
        them by `num_replicas_in_sync`; keras_dist warns when asked to.
        """
        op = ReduceOp.parse(reduce_op)
        collective = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
        leaves = jax.tree.leaves(value)
        if op is ReduceOp.SUM and leaves and not any(varies(v) for v in leaves):
            warnings.warn(
                "all_reduce('sum') of a value that is already the same on every "
                "replica multiplies it by num_replicas_in_sync="
                f"{self.num_replicas_in_sync}. Gradients of replicated weights "
                "come out of jax.grad already summed over the replicas: apply "
                "them without all_reduce.",
                stacklevel=2,
            )
        return jax.tree.map(lambda v: collective(v, AXIS), value)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's `value` along `axis` (pytrees too)."""
        return jax.tree.map(
            lambda v: jax.lax.all_gather(v, AXIS, axis=axis, tiled=True), value
        )

    def all_finite(self, value: Any) -> jax.Array:
        """Whether every leaf of `value` is finite on every replica.

        One boolean scalar, the same on every replica: an inf or NaN on any
        replica makes it False everywhere (one `pmin` over the replicas), as
        tf's `LossScaleOptimizer` decides to skip a step on all replicas when
        one overflows. Use it to make a per-replica decision global, e.g. to
        skip an update computed from per-replica values.

        Example:

        ```python
        def step(weights, grads):  # inside strategy.run
            ok = kd.get_replica_context().all_finite(grads)
            return jax.tree.map(
                lambda w, g: jnp.where(ok, w - 0.1 * g, w), weights, grads
            )
        ```

        Args:
            value: a pytree of arrays (integer and boolean leaves count as
                finite; `None` leaves are ignored).

        Returns:
            A boolean scalar `jax.Array`, not varying over the replicas.
        """
        return all_replicas(finite(value))

    def example_mask(self, rows: int) -> jax.Array | None:
        """1 for this replica's real rows, 0 for padding; None when unpadded.

        Raises:
            ValueError: if `rows` is not the number of rows of this replica's
                batch, so real and padded rows cannot be told apart.
        """
        if self.num_real is None:
            return None
        if rows != self.per_replica_batch:
            raise ValueError(
                "The batch given to `strategy.run` was padded (a partial last "
                f"batch of {total_real(self.num_real)} examples), so per-example "
                f"values must have one row per example of the replica's batch "
                f"({self.per_replica_batch} rows). Received a value with "
                f"{rows} rows."
            )
        first = self.replica_id_in_sync_group * rows
        return real_mask(first + jnp.arange(rows), self.num_real)

    def global_batch_size(self, rows: int) -> int:
        """The real number of examples in the global batch."""
        if self.num_real is not None:
            return total_real(self.num_real)
        return rows * self.num_replicas_in_sync

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self.strategy!r})"


class _DefaultReplicaContext(ReplicaContext):
    """The context outside any strategy: one replica, collectives are identities."""

    def __init__(self) -> None:
        self.strategy = None
        self.per_replica_batch = None
        self.num_real = None
        self._in_run = False

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        return jnp.asarray(0, dtype="int32")

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any) -> Any:
        ReduceOp.parse(reduce_op)
        return value

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        return value

    def all_finite(self, value: Any) -> jax.Array:
        return finite(value)

    def __repr__(self) -> str:
        return "ReplicaContext(default, num_replicas_in_sync=1)"


def finite(value: Any) -> jax.Array:
    """Whether every leaf of `value` is finite (on this replica)."""
    flags = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(value)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def all_replicas(flag: jax.Array) -> jax.Array:
    """`flag` (a boolean scalar traced in `run`) and-ed over the replicas."""
    if not varies(flag):
        return flag  # Already the same on every replica.
    return jax.lax.pmin(flag.astype("int32"), AXIS).astype("bool")


def varies(value: Any, *, unknown: bool = True) -> bool:
    """Whether JAX knows `value` (traced in `run`) to differ between replicas.

    `unknown` when this JAX version does not say (by default True:
    conservative for outputs of `run`).
    """
    aval = jax.typeof(value)
    mat = getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", None)
    return unknown if varying is None else AXIS in varying


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, as `tf.distribute.get_replica_context`.

    Inside a function run by `strategy.run`: that replica's context. Inside a
    `strategy.scope()` but outside `run` (the cross-replica context): `None`.
    With no strategy at all: a default context of one replica.

    Example:

    ```python
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        print(kd.get_replica_context())  # None: the cross-replica context

    def step(batch):
        ctx = kd.get_replica_context()
        return ctx.replica_id_in_sync_group  # 0 ... num_replicas_in_sync - 1

    strategy.run(step, args=(dist_batch,))
    ```
    """
    current = _CURRENT.get()
    if current is not None:
        return current
    if _ownership.is_strategy(keras.distribution.distribution()):
        return None
    return _DefaultReplicaContext()


def in_replica_context() -> ReplicaContext | None:
    """The context of the replica being traced by `run`, else None."""
    return _CURRENT.get()


@contextlib.contextmanager
def replica_context(context: ReplicaContext) -> Iterator[ReplicaContext]:
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
