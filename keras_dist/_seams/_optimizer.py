"""Seams 5 and 10: optimizer state laid out by the strategy; loss scaling.

Keras creates every optimizer slot (momentum, Adam's moments, gradient
accumulators) with `BaseOptimizer.add_variable_from_reference`, which gives
the slot its model variable's layout. `Strategy.get_variable_layout` is never
asked, so a strategy cannot shard the slots of replicated weights there. This
seam hands Keras's own method a view of the reference variable whose layout is
the strategy's `state_layout.slot_layout(variable)` — everything else (name,
shape, dtype, initializer) stays Keras's.

Seam 10: `LossScaleOptimizer.stateless_apply` decides whether a step is
skipped from the gradients it is given (`check_finite`). Inside
`strategy.run`, gradients of the replicated weights are summed over the
replicas by JAX, so the decision is the same on every replica (an overflow
on one replica skips the step on all, as in tf.distribute). Gradients that
differ by replica (of each replica's own copy of the weights, not reduced)
would make each replica decide alone; Keras's `cond` then fails with a JAX
type error about manual axes. The seam refuses them first and says the fix.
"""

import functools
from collections.abc import Callable

import keras

from keras_dist._private_api._wrapped import marked
from keras_dist.strategies._base import Strategy, strategy_of_variable
from keras_dist.strategies.replica._replica_context import in_replica_context, varies

__all__ = ["_add_variable_from_reference", "_check_finite", "_stateless_apply"]


class _WithLayout:
    """`variable`, but with `_layout` replaced."""

    def __init__(self, variable, layout):
        self._variable = variable
        self._layout = layout

    def __getattr__(self, name):
        return getattr(self._variable, name)


def _add_variable_from_reference(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(optimizer, reference_variable, *args, **kwargs):
        # The weight's strategy decides, also when the optimizer is built
        # outside the scope (`optimizer.build(model.trainable_variables)`).
        strategy = strategy_of_variable(reference_variable)
        if strategy is None:
            strategy = keras.distribution.distribution()
        if isinstance(strategy, Strategy):
            layout = strategy.state_layout.slot_layout(reference_variable)
            if layout is not None:
                reference_variable = _WithLayout(reference_variable, layout)
        return method(optimizer, reference_variable, *args, **kwargs)

    marked(wrapper, method)
    return wrapper


def _stateless_apply(method: Callable) -> Callable:
    """Gradients whole before a ZeRO-1 update: the replicated run's bits.

    With split slots, XLA would reduce the gradients with a reduce-scatter
    (another summation order than the all-reduce of the replicated run); a
    replicated-layout constraint keeps the all-reduce, and each device then
    updates its part of the slots.
    """

    @functools.wraps(method)
    def wrapper(optimizer, optimizer_variables, grads, trainable_variables):
        strategy = keras.distribution.distribution()
        if (
            isinstance(strategy, Strategy)
            and strategy.state_layout.slots_need_whole_gradients
        ):
            grads = [
                g if g is None else strategy.state_layout.replicated_constraint(g)
                for g in grads
            ]
        return method(optimizer, optimizer_variables, grads, trainable_variables)

    marked(wrapper, method)
    return wrapper


def _check_finite(method: Callable) -> Callable:
    """Inside `strategy.run`: refuses gradients that differ by replica."""

    @functools.wraps(method)
    def wrapper(optimizer, grads):
        if in_replica_context() is not None:
            _check_same_on_every_replica(grads)
        return method(optimizer, grads)

    marked(wrapper, method)
    return wrapper


def _check_same_on_every_replica(grads) -> None:
    for index, grad in enumerate(grads):
        if grad is not None and varies(grad, unknown=False):
            raise ValueError(
                "LossScaleOptimizer inside `strategy.run` got gradients that "
                "differ by replica: each replica would decide alone whether "
                f"to skip the step. Received: grads[{index}] of shape "
                f"{tuple(grad.shape)}, varying over the replicas. Sum them "
                "over the replicas first, as tf.distribute does: "
                '`grads = kd.get_replica_context().all_reduce("sum", grads)`; '
                "or take `jax.grad` with respect to the weights `run` was "
                "given (replicated), which JAX already sums."
            )
