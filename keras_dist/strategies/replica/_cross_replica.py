"""`reduce`, `gather` and `experimental_local_results`: combining replicas.

Called in the cross-replica context (outside `run`). A value can be a
`PerReplica`, a global array split over the replicas along its batch axis (a
batch of a distributed dataset), or any other array, which counts as the same
value on every replica (so a SUM over replicas multiplies it by the number of
replicas, as the replicas would). All three accept pytrees, and refuse a
`PerReplica` or a batch of another strategy (split over other devices).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from keras_dist.data._partial_batch import take_real
from keras_dist.strategies.placement._placement import num_real_of
from keras_dist.strategies.replica._replica_context import in_replica_context
from keras_dist.strategies.replica._values import (
    PerReplica,
    ReduceOp,
    concat_replicas,
    foreign_mesh,
    is_per_replica,
    other_strategy_error,
    real_rows,
)
from keras_dist.strategies.state._parts import StrategyParts

__all__ = ["experimental_local_results", "gather", "reduce"]


def _cross_replica_only(name: str) -> None:
    if in_replica_context() is not None:
        raise RuntimeError(
            f"`strategy.{name}` combines the replicas' values and is called "
            "outside `strategy.run`. Inside the function given to `run`, use "
            "`kd.get_replica_context().all_reduce(op, value)` or "
            "`.all_gather(value, axis)`."
        )


def _check_same_strategy(strategy: StrategyParts, leaf, name: str, value: Any) -> None:
    """Refuses a `PerReplica` or batch split over another strategy's mesh."""
    mesh = foreign_mesh(strategy, leaf)
    if mesh is None:
        return
    argument = "value"
    for path, other in jax.tree_util.tree_flatten_with_path(
        value, is_leaf=is_per_replica
    )[0]:
        if other is leaf:
            argument += jax.tree_util.keystr(path)
            break
    made = (
        "whose `run` returned it"
        if isinstance(leaf, PerReplica)
        else "that distributed it"
    )
    raise other_strategy_error(
        strategy,
        leaf,
        mesh,
        call=f"strategy.{name}",
        argument=argument,
        fix=f"Call `{name}` on the strategy {made}.",
    )


def _as_per_replica(strategy: StrategyParts, leaf) -> PerReplica | None:
    if isinstance(leaf, PerReplica):
        return leaf
    if isinstance(leaf, jax.Array) and strategy.placement.is_batch_sharded(leaf):
        replicas = strategy.num_replicas_in_sync
        b = leaf.shape[0] // replicas
        return PerReplica(
            leaf.reshape(replicas, b, *leaf.shape[1:]),
            num_real=num_real_of(leaf),
            per_replica_batch=b,
            strategy=strategy,
        )
    return None


def _check_axis(axis, value_ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"`axis` must be an int or None. Received: axis={axis!r}.")
    if not -value_ndim <= axis < value_ndim:
        raise ValueError(
            f"`axis` is out of range for per-replica values of rank {value_ndim}. "
            f"Received: axis={axis}."
        )
    return axis % value_ndim


def _concat(value: PerReplica, axis: int) -> jax.Array:
    merged = concat_replicas(value.stacked, axis)
    if axis == 0 and value.num_real is not None and value.is_per_example():
        merged = take_real(merged, value.num_real)
    return merged


def gather(strategy: StrategyParts, value: Any, axis: int) -> Any:
    _cross_replica_only("gather")

    def one(leaf):
        _check_same_strategy(strategy, leaf, "gather", value)
        per_replica = _as_per_replica(strategy, leaf)
        if per_replica is None:
            leaf = jnp.asarray(leaf)
            k = _check_axis(axis, leaf.ndim)
            return jnp.concatenate([leaf] * strategy.num_replicas_in_sync, axis=k)
        k = _check_axis(axis, per_replica.stacked.ndim - 1)
        return _concat(per_replica, k)

    return _everywhere(strategy, jax.tree.map(one, value, is_leaf=is_per_replica))


def _everywhere(strategy: StrategyParts, result: Any) -> Any:
    """With several processes: the whole result on every process (replicated).

    Paced as `run`'s outputs are: a custom loop's `reduce` and `gather` are
    collectives too, dispatched every step, and on CPU devices too many of
    them in flight abort XLA as run's would (`Pacer`).
    """
    if strategy.spans_processes:
        result = _copy_to(strategy.state_layout.replicated)(result)
    strategy.pacer.after(result)
    return result


@functools.cache
def _copy_to(sharding):
    """One compiled copy per sharding (reduce/gather run every step)."""
    return jax.jit(lambda tree: tree, out_shardings=sharding)


def reduce(
    strategy: StrategyParts, reduce_op, value: Any, axis: int | None = None
) -> Any:
    op = ReduceOp.parse(reduce_op)
    _cross_replica_only("reduce")
    replicas = strategy.num_replicas_in_sync

    def one(leaf):
        _check_same_strategy(strategy, leaf, "reduce", value)
        per_replica = _as_per_replica(strategy, leaf)
        if per_replica is None:
            leaf = jnp.asarray(leaf)
            if axis is not None:
                k = _check_axis(axis, leaf.ndim)
                return leaf.sum(k) * replicas if op is ReduceOp.SUM else leaf.mean(k)
            return leaf * replicas if op is ReduceOp.SUM else leaf
        if axis is None:
            stacked = per_replica.stacked
            return stacked.sum(0) if op is ReduceOp.SUM else stacked.mean(0)
        k = _check_axis(axis, per_replica.stacked.ndim - 1)
        merged = _concat(per_replica, k)
        return merged.sum(k) if op is ReduceOp.SUM else merged.mean(k)

    return _everywhere(strategy, jax.tree.map(one, value, is_leaf=is_per_replica))


def experimental_local_results(strategy: StrategyParts, value: Any) -> tuple:
    """A tuple of the value of each replica of this process (pytrees too)."""
    _cross_replica_only("experimental_local_results")
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
    local = [
        i
        for i, d in enumerate(strategy.placement.replica_devices)
        if d.process_index == jax.process_index()
    ]
    for leaf in leaves:
        _check_same_strategy(strategy, leaf, "experimental_local_results", value)
    per_leaf = [_local_values(strategy, leaf, local) for leaf in leaves]
    if not leaves:
        return (value,)
    count = len(per_leaf[0])
    return tuple(
        jax.tree.unflatten(treedef, [values[i] for values in per_leaf])
        for i in range(count)
    )


def _local_values(strategy: StrategyParts, leaf, local: list[int]) -> list:
    if isinstance(leaf, jax.Array) and strategy.placement.is_batch_sharded(leaf):
        shards = {s.device: s.data for s in leaf.addressable_shards}
        b = leaf.shape[0] // strategy.num_replicas_in_sync
        num_real = num_real_of(leaf)
        return [
            shards[strategy.placement.replica_devices[i]][: real_rows(num_real, b, i)]
            for i in local
        ]
    per_replica = _as_per_replica(strategy, leaf)
    if per_replica is None:
        array = jnp.asarray(leaf)
        if isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated:
            by_device = {s.device: s.data for s in leaf.addressable_shards}
            devices = [strategy.placement.replica_devices[i] for i in local]
            if all(d in by_device for d in devices):
                return [by_device[d] for d in devices]
        return [array for _ in local]
    shards = {s.device: s.data for s in per_replica.stacked.addressable_shards}
    out = []
    for i in local:
        device_value = shards[strategy.placement.replica_devices[i]][0]
        if per_replica.num_real is not None and per_replica.is_per_example():
            device_value = device_value[: per_replica.real_rows(i)]
        out.append(device_value)
    return out
