"""Seam 9: `gradient_accumulation_steps` as Keras documents it, under a strategy.

Keras 3.15's JAX optimizer computes the full update on every micro-step and
discards it unless the step is an update step, and a `LearningRateSchedule`
sees micro-steps (`keras_dist/training/_gradient_accumulation.py` says why
and what keras_dist does instead). Two wrappers hand an optimizer that
accumulates gradients and belongs to a keras_dist strategy to that module:

- `JaxOptimizer._backend_apply_gradients` (the update of one `apply`):
  accumulate, and on every N-th micro-step run the original — Keras's own
  update — on the mean gradients, as without accumulation;
- `BaseOptimizer._get_current_learning_rate` (`optimizer.learning_rate`,
  read inside the update and by callbacks): a schedule is evaluated at the
  number of updates, `optimizer.iterations`;
- `BaseOptimizer.iterations`: while Keras's own update runs (accumulation
  off for its duration), still the number of updates (its EMA reads it).

Every other optimizer runs Keras's own code.
"""

import functools
from collections.abc import Callable

import keras

from keras_dist._private_api._wrapped import marked
from keras_dist.training._gradient_accumulation import (
    accumulates_under_strategy,
    apply_accumulated,
    schedule_step,
    update_number,
)

__all__ = ["_backend_apply_gradients", "_get_current_learning_rate", "_iterations"]


def _backend_apply_gradients(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(optimizer, grads, trainable_variables):
        if not accumulates_under_strategy(optimizer):
            return method(optimizer, grads, trainable_variables)
        return apply_accumulated(optimizer, grads, trainable_variables, method)

    marked(wrapper, method)
    return wrapper


def _get_current_learning_rate(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(optimizer):
        schedule = optimizer._learning_rate
        if isinstance(
            schedule, keras.optimizers.schedules.LearningRateSchedule
        ) and accumulates_under_strategy(optimizer):
            return schedule(schedule_step(optimizer))
        return method(optimizer)

    marked(wrapper, method)
    return wrapper


def _iterations(iterations: property) -> property:
    read = iterations.fget
    if read is None:
        raise TypeError(
            "keras_dist cannot wrap Keras's `BaseOptimizer.iterations`: this Keras "
            "version defines it without a getter. Use a Keras version keras_dist "
            "supports (`keras_dist._seams.CHECKED_KERAS`)."
        )

    @functools.wraps(read)
    def updates(optimizer):
        number = update_number(optimizer)
        return read(optimizer) if number is None else number

    marked(updates, read)
    return property(updates, iterations.fset, iterations.fdel, iterations.__doc__)
