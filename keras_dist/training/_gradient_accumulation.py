"""`gradient_accumulation_steps=N`: one optimizer update per N micro-batches.

Keras documents that with `gradient_accumulation_steps=N` "model & optimizer
variables will not be updated at every step; instead they will be updated
every N steps, using the average value of the gradients since the last
update", and that `optimizer.iterations` counts updates
(`_iterations // N`). Keras 3.15's JAX backend
(`JaxOptimizer._backend_apply_gradients`) instead computes the whole update
on every micro-step and throws it away with `lax.cond` unless the step is an
update step (N times the update's cost), and evaluates a
`LearningRateSchedule` at the micro-step count `_iterations`: a schedule runs
N times too fast (with `PiecewiseConstantDecay`, accumulation 2 at batch 16
ends far from batch 32).

Under a keras_dist strategy:

- `apply` adds each micro-batch's gradients to the accumulators (laid out
  like optimizer state: `add_variable_from_reference` goes through the
  strategy's `state_layout.slot_layout`, so ZeRO-1 and FSDP split them); on every N-th
  micro-step Keras's own update — its non-accumulating branch: clipping,
  weight decay, `update_step` and EMA — runs on the mean of the N
  gradients inside the taken branch of a `lax.cond`, in its own
  `StatelessScope`, and resets the accumulators. The other branch only
  accumulates.
- `schedule_step` is the step a `LearningRateSchedule` sees:
  `optimizer.iterations`, the number of updates made. So a schedule, a
  callback reading `optimizer.learning_rate` and EMA all count updates.

With the same global batch per update (accumulation N at batch B against
batch N*B without it), the weights and `optimizer.iterations` are those of
the run without accumulation, when the number of rows is a multiple of N*B.
A partial last micro-batch weighs like a full one (its mean gradient is one
of the N averaged), as in Keras; a layer that computes batch statistics
(BatchNormalization) sees micro-batches.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_dist._private_api import _access
from keras_dist.strategies._base import Strategy, strategy_of_variable

__all__ = [
    "accumulates_under_strategy",
    "apply_accumulated",
    "schedule_step",
    "update_number",
]

# While Keras's own update runs for an accumulating optimizer (inside the
# taken branch): (the optimizer, the number of updates made before this one).
_KERAS_UPDATE: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "keras_dist_keras_update", default=None
)


def accumulates_under_strategy(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `optimizer` accumulates gradients and belongs to a strategy."""
    if update_number(optimizer) is not None:
        return True
    if not getattr(optimizer, "gradient_accumulation_steps", None):
        return False
    iterations = _access.micro_steps(optimizer)
    if isinstance(strategy_of_variable(iterations), Strategy):
        return True
    return isinstance(keras.distribution.distribution(), Strategy)


def update_number(optimizer: keras.optimizers.Optimizer) -> Any:
    """While Keras's own update of `optimizer` runs: the updates made so far."""
    running = _KERAS_UPDATE.get()
    return running[1] if running is not None and running[0] is optimizer else None


def schedule_step(optimizer: keras.optimizers.Optimizer):
    """The step a learning-rate schedule sees: updates made so far."""
    number = update_number(optimizer)
    return optimizer.iterations if number is None else number


def apply_accumulated(
    optimizer: keras.optimizers.Optimizer,
    grads: list,
    trainable_variables: list,
    keras_update: Callable,
) -> None:
    """Accumulates `grads`; on every N-th call, updates with their mean.

    Args:
        optimizer: a built Keras optimizer with `gradient_accumulation_steps`.
        grads: the micro-batch's gradients, one per variable (no `None`).
        trainable_variables: the variables `grads` belong to (a subset of
            those the optimizer was built with).
        keras_update: Keras's own `_backend_apply_gradients(optimizer, grads,
            variables)`, run as without accumulation on the mean gradients
            (clipping, weight decay, `update_step`, EMA).
    """
    steps = optimizer.gradient_accumulation_steps
    accumulators = _access.accumulated_gradients(optimizer, trainable_variables)
    state = _update_state(optimizer)
    is_update_step = (_access.micro_steps(optimizer).value + 1) % steps == 0
    updates_made = optimizer.iterations

    def update(values, grads, sums):
        mapping = list(zip(state, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            mean = [(g + s) / steps for g, s in zip(grads, sums, strict=True)]
            with _as_one_update(optimizer, updates_made):
                keras_update(optimizer, mean, trainable_variables)
        new = [scope.get_current_value(v) for v in state]
        new = [_like(x, old) for x, old in zip(new, values, strict=True)]
        return new, [jnp.zeros_like(s) for s in sums]

    def accumulate(values, grads, sums):
        added = [_like(g + s, s) for g, s in zip(grads, sums, strict=True)]
        return list(values), added

    values, sums = jax.lax.cond(
        is_update_step,
        update,
        accumulate,
        [v.value for v in state],
        list(grads),
        [a.value for a in accumulators],
    )
    for variable, value in zip(state, values, strict=True):
        variable.assign(value)
    for accumulator, value in zip(accumulators, sums, strict=True):
        accumulator.assign(value)


@contextlib.contextmanager
def _as_one_update(optimizer, updates_made) -> Iterator[None]:
    """Keras's update as without accumulation, counting updates, not micro-steps.

    `gradient_accumulation_steps` is off for its duration (so Keras takes
    its non-accumulating branch); `optimizer.iterations` and a schedule's
    step read `updates_made` (`update_number`), as they do outside.
    """
    steps = optimizer.gradient_accumulation_steps
    token = _KERAS_UPDATE.set((optimizer, updates_made))
    optimizer.gradient_accumulation_steps = None
    try:
        yield
    finally:
        optimizer.gradient_accumulation_steps = steps
        _KERAS_UPDATE.reset(token)


def _update_state(optimizer) -> list:
    """Every variable an update reads or writes, but the accumulators."""
    skip = {id(a) for a in _access.accumulated_gradients(optimizer) if a is not None}
    state, seen = [], skip
    trainable = _access.optimizer_trainable_variables(optimizer)
    for variable in (*trainable, *optimizer.variables):
        if id(variable) not in seen:
            seen.add(id(variable))
            state.append(variable)
    return state


def _like(value, reference):
    return jnp.asarray(value, dtype=reference.dtype)
