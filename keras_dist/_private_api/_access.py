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

import importlib.abc
import importlib.util
import sys
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
    "set_random_seed",
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


def set_random_seed(seed: int) -> None:
    """`keras.utils.set_random_seed(seed)` without importing TensorFlow.

    Keras's sets TensorFlow's seed too (for tf.data's shuffles) whenever
    TensorFlow is installed, importing it: seconds of start-up and its
    start-up lines in a program that never uses it. Here TensorFlow's seed
    is set now if the program has imported TensorFlow, else right after it
    does (a finder on `sys.meta_path`, once).
    """
    if sys.modules.get("tensorflow") is not None:
        keras.utils.set_random_seed(seed)
        return
    from keras.src.utils import rng_utils

    tensorflow = rng_utils.tf
    rng_utils.tf = _NotImported()
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = tensorflow
    if "tensorflow" not in sys.modules:  # None: the program blocked it.
        for finder in [f for f in sys.meta_path if isinstance(f, _SeedOnImport)]:
            sys.meta_path.remove(finder)
        sys.meta_path.insert(0, _SeedOnImport(seed))


class _NotImported:
    """Keras's lazy TensorFlow module, as Keras sees it when TensorFlow is
    not installed."""

    available = False


class _SeedOnImport(importlib.abc.MetaPathFinder):
    """Sets TensorFlow's global seed right after `import tensorflow` runs."""

    def __init__(self, seed: int):
        self.seed = seed

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)  # Once; the search below without it.
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _SeedingLoader(spec.loader, self.seed)
        return spec


class _SeedingLoader(importlib.abc.Loader):
    """TensorFlow's own loader, then `tf.random.set_seed`."""

    def __init__(self, loader, seed: int):
        self._loader, self._seed = loader, seed

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.random.set_seed(self._seed)

    def __getattr__(self, name: str):  # Resources, source: the loader's.
        return getattr(self._loader, name)


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
