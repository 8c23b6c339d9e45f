"""The private Keras reads and writes of the other layers, behind public names.

Keras has no public API for these (each is listed in `_private.py` with the
reason): the optimizer's learning-rate object (its public `learning_rate`
is the evaluated rate, and its setter cannot put a variable back once a
schedule is installed), its micro-step counter and gradient accumulators,
the layout a variable was created with, the epoch `fit` starts from, the
state the JAX trainer holds between steps, the arguments `compile` was
called with and those a loss passes its function. Imports nothing of keras_dist:
any layer may call these.
"""

from typing import Any

import keras
import numpy as np

__all__ = [
    "accumulated_gradients",
    "assigned_layout",
    "compile_arguments",
    "global_seed",
    "learning_rate_object",
    "loss_function_arguments",
    "micro_steps",
    "optimizer_trainable_variables",
    "set_initial_epoch",
    "set_learning_rate_object",
    "step_counter",
    "sync_state",
    "track_variable",
]


def assigned_layout(variable: Any) -> Any:
    """The layout `variable` was created with (Keras's own check), or None."""
    return getattr(variable, "_layout", None)


def learning_rate_object(optimizer: Any) -> Any:
    """What the optimizer computes its rate from: a float, a variable, a
    `LearningRateSchedule` or a callable (`optimizer.learning_rate` is the
    value it evaluates to)."""
    return getattr(optimizer, "_learning_rate", None)


def set_learning_rate_object(optimizer: Any, value: Any) -> None:
    """Makes `value` (a variable or a schedule) what the optimizer computes
    its rate from, keeping its variables as they are tracked."""
    optimizer._learning_rate = value


def track_variable(optimizer: Any, variable: Any) -> None:
    """Adds `variable` to `optimizer.variables` (saved and restored with it)."""
    optimizer._track_variable(variable)


def micro_steps(optimizer: Any) -> Any:
    """The optimizer's counter of applied batches (micro-batches under
    gradient accumulation; `optimizer.iterations` counts updates), or None."""
    return getattr(optimizer, "_iterations", None)


def accumulated_gradients(optimizer: Any, variables: Any = None) -> list:
    """The gradient accumulators of `variables` (all: every variable's, None
    for variables that have none)."""
    if variables is None:
        return list(optimizer._accumulated_gradients)
    return [
        optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
        for v in variables
    ]


def optimizer_trainable_variables(optimizer: Any) -> list:
    """The model variables the optimizer was built with."""
    return list(optimizer._trainable_variables)


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch `fit` starts from (Keras's `BackupAndRestore` sets it so)."""
    model._initial_epoch = epoch


def compile_arguments(model: Any) -> dict:
    """The arguments `model.compile` was called with, as passed (loss and
    metrics objects, names, functions); empty before `compile`.

    The public `get_compile_config()` serializes them, and Keras's serializer
    imports TensorFlow where it is installed (to test for a `TensorShape`):
    a large import at the first `fit`, which the same `fit` without
    keras_dist does not pay.
    """
    config = getattr(model, "_compile_config", None)
    return dict(getattr(config, "config", None) or {})


def loss_function_arguments(loss: Any) -> dict:
    """The keyword arguments a loss made from a function (Keras's
    `LossFunctionWrapper`) passes it, e.g. `ignore_class`; empty for another
    loss. Its `get_config()` serializes the function too, which imports
    TensorFlow."""
    return dict(getattr(loss, "_fn_kwargs", None) or {})


def global_seed() -> int | None:
    """The seed `keras.utils.set_random_seed` set, if any."""
    from keras.src.utils.rng_utils import get_random_seed

    return get_random_seed()


def sync_state(model) -> None:
    """Writes the state a running `fit` holds back into the Keras variables.

    The JAX trainer keeps the state outside the variables between steps;
    after this, variables can be read or assigned, and the trainer re-reads
    them before its next step.
    """
    if getattr(model, "_jax_state", None) and not getattr(
        model, "_jax_state_synced", True
    ):
        model.jax_state_sync()


def step_counter(optimizer) -> int:
    """How many times `optimizer` was applied (micro-batches under accumulation).

    `optimizer.iterations` counts updates: with `gradient_accumulation_steps`
    it is `_iterations // N`, an array, and repeats over N micro-batches.
    A `LossScaleOptimizer` counts in its inner optimizer (its own
    `_iterations` never moves); a step it skipped is not counted.
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return int(np.asarray(optimizer._iterations.value))
