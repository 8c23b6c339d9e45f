"""`Strategy.run`: one call of a function per replica, with `jax.shard_map`.

Each leaf of the arguments is classified once:

- a global array split along the batch axis over the strategy's mesh (a
  batch of a distributed dataset): each replica gets its own rows;
- a `PerReplica` (the output of an earlier `run`): each replica gets its own;
- a batch or `PerReplica` of another strategy (another mesh): refused, it
  would otherwise reach every replica whole;
- any other array (weights, optimizer state, NumPy arrays): every replica
  gets the whole value, replicated, as in tf.distribute; a variable split
  over the mesh (FSDP, a partitioner, ZeRO-1 slots) is gathered inside the
  compiled step (it is never taken for a batch: with split state, a batch is
  only what the strategy's input pipeline laid out);
- anything else hashable (Python numbers, strings): a compile-time constant.

The function is traced inside `shard_map` over the axis `"batch"` and
compiled once per argument structure, shapes and constants. JAX tracks which
outputs vary over the replicas: those come back as `PerReplica`; outputs that
are the same on every replica (e.g. weights updated from all-reduced
gradients) come back as one replicated `jax.Array`, like tf.distribute's
mirrored values.
"""

import enum
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.strategies.placement._placement import num_real_of
from keras_dist.strategies.replica._replica_context import (
    AXIS,
    ReplicaContext,
    replica_context,
    varies,
)
from keras_dist.strategies.replica._values import (
    PerReplica,
    foreign_batch_mesh,
    foreign_mesh,
    is_per_replica,
    other_strategy_error,
)
from keras_dist.strategies.state._parts import StrategyParts

__all__ = ["run"]


class _Kind(enum.Enum):
    BATCH = "batch"
    STACKED = "stacked"
    REPLICATED = "replicated"
    STATIC = "static"


def run(
    strategy: StrategyParts,
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    cache: dict,
) -> Any:
    """`strategy.run`; `cache` keeps the strategy's compiled programs."""
    if not callable(fn):
        raise TypeError(f"`fn` must be callable. Received: fn={fn!r}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            "`args` must be a tuple of positional arguments. Received: "
            f"args={args!r}. For one argument write args=(x,)."
        )
    tree = (tuple(args), dict(kwargs or {}))
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_per_replica)
    kinds, values, statics, batch = _classify(strategy, leaves, tree)
    key = (
        fn,
        treedef,
        tuple(kinds),
        tuple(statics),
        batch,
        tuple((v.shape, v.dtype) for v in values),
    )
    compiled = cache.get(key)
    if compiled is None:
        compiled = _compile(strategy, fn, treedef, kinds, statics, batch, values)
        cache[key] = compiled
    outputs = compiled(values)
    strategy.pacer.after(outputs)
    return outputs


def _classify(strategy: StrategyParts, leaves, tree):
    kinds, values, statics = [], [], []
    per_replica_batch, num_real = None, None
    replicas = strategy.num_replicas_in_sync
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, PerReplica):
            _check_same_strategy(strategy, leaf, tree, index)
            _check_replicas(leaf, replicas)
            kinds.append(_Kind.STACKED)
            values.append(leaf.stacked)
            if leaf.per_replica_batch is not None and per_replica_batch is None:
                per_replica_batch, num_real = leaf.per_replica_batch, leaf.num_real
        elif isinstance(leaf, jax.Array):
            if strategy.placement.is_batch_sharded(leaf):
                kinds.append(_Kind.BATCH)
                values.append(leaf)
                if per_replica_batch is None:
                    per_replica_batch = leaf.shape[0] // replicas
                    num_real = num_real_of(leaf)
                continue
            if foreign_batch_mesh(strategy, leaf) is not None:
                _check_same_strategy(strategy, leaf, tree, index)
            kinds.append(_Kind.REPLICATED)
            # A variable split over this mesh (FSDP, a partitioner, ZeRO-1
            # slots) is gathered inside the compiled step, where it is used.
            values.append(
                leaf
                if _split_state(strategy, leaf)
                else strategy.placement.replicate(leaf)
            )
        elif isinstance(leaf, (np.ndarray, np.generic)):
            kinds.append(_Kind.REPLICATED)
            values.append(strategy.placement.replicate(leaf))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    "Arguments of `strategy.run` must be arrays, pytrees of "
                    "arrays, or hashable constants. Received an argument of "
                    f"type {type(leaf).__name__}: {leaf!r}."
                ) from None
            kinds.append(_Kind.STATIC)
            statics.append(leaf)
    return kinds, values, statics, (per_replica_batch, num_real)


def _split_state(strategy: StrategyParts, leaf: jax.Array) -> bool:
    sharding = leaf.sharding
    return (
        strategy.state_layout.splits_state
        and isinstance(sharding, NamedSharding)
        and sharding.mesh == strategy.mesh
        and not sharding.is_fully_replicated
    )


def _check_same_strategy(strategy: StrategyParts, leaf, tree, index: int) -> None:
    """Refuses a batch or `PerReplica` split over another strategy's mesh."""
    mesh = foreign_mesh(strategy, leaf)
    if mesh is None:
        return
    path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_per_replica)[0]
    keys = path[index][0]
    argument = ("args", "kwargs")[keys[0].idx] + jax.tree_util.keystr(keys[1:])
    if isinstance(leaf, PerReplica):
        fix = (
            "Run every step on the strategy whose `run` made the value, or "
            "combine it first with that strategy's `reduce`/`gather`."
        )
    else:
        fix = (
            "Distribute the dataset with the strategy that runs the step: "
            "`for batch in strategy.experimental_distribute_dataset(dataset): "
            "strategy.run(fn, args=(batch,))`, with one `strategy`."
        )
    raise other_strategy_error(
        strategy, leaf, mesh, call="strategy.run", argument=argument, fix=fix
    )


def _check_replicas(value: PerReplica, replicas: int) -> None:
    if value.num_replicas != replicas:
        raise ValueError(
            f"A PerReplica value of {value.num_replicas} replicas was passed to "
            f"a strategy of {replicas} replicas. Received: {value!r}."
        )


def _compile(strategy: StrategyParts, fn, treedef, kinds, statics, batch, values):
    per_replica_batch, num_real = batch
    specs = [
        PartitionSpec() if kind is _Kind.REPLICATED else PartitionSpec(AXIS)
        for kind in kinds
        if kind is not _Kind.STATIC
    ]
    out: dict[str, Any] = {}

    def body(varying, *vals):
        vals_it, statics_it = iter(vals), iter(statics)
        rebuilt = []
        for kind in kinds:
            if kind is _Kind.STATIC:
                rebuilt.append(next(statics_it))
            elif kind is _Kind.STACKED:
                rebuilt.append(next(vals_it)[0])
            else:
                rebuilt.append(next(vals_it))
        call_args, call_kwargs = jax.tree.unflatten(treedef, rebuilt)
        context = ReplicaContext(
            strategy, per_replica_batch=per_replica_batch, num_real=num_real
        )
        with replica_context(context):
            result = fn(*call_args, **call_kwargs)
        leaves, out["tree"] = jax.tree.flatten(result)
        leaves = [_as_array(leaf, fn) for leaf in leaves]
        if varying is None:  # Probe: learn which outputs vary over replicas.
            out["varying"] = [varies(leaf) for leaf in leaves]
            return [leaf[None] for leaf in leaves]
        return [
            leaf[None] if v else leaf for leaf, v in zip(leaves, varying, strict=True)
        ]

    def shard_mapped(varying):
        out_specs = (
            PartitionSpec(AXIS)
            if varying is None
            else [PartitionSpec(AXIS) if v else PartitionSpec() for v in varying]
        )
        # Manual over the replicas only: on a 2-D mesh the model axis is
        # left to XLA, which splits each replica's work as its layouts say.
        # (On a 1-D mesh, shard_map's default: every axis.)
        manual = frozenset() if strategy.model_parallel == 1 else {AXIS}
        return jax.shard_map(
            lambda *vals: body(varying, *vals),
            mesh=strategy.mesh,
            in_specs=tuple(specs),
            out_specs=out_specs,
            axis_names=manual,
        )

    jax.eval_shape(shard_mapped(None), *values)
    varying = out["varying"]
    jitted = jax.jit(shard_mapped(varying))

    def call(vals):
        leaves = jitted(*vals)
        wrapped = [
            PerReplica(
                leaf,
                num_real=num_real,
                per_replica_batch=per_replica_batch,
                strategy=strategy,
            )
            if v
            else leaf
            for leaf, v in zip(leaves, varying, strict=True)
        ]
        return jax.tree.unflatten(out["tree"], wrapped)

    return call


def _as_array(leaf, fn):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        return jax.numpy.asarray(leaf)
    raise TypeError(
        f"The function given to `strategy.run` ({getattr(fn, '__name__', fn)!r}) "
        "must return arrays or pytrees (tuples, lists, dicts) of arrays. "
        f"Received an output of type {type(leaf).__name__}: {leaf!r}."
    )
