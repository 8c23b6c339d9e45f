"""One learning-rate object the keras_dist LR callbacks drive together.

`LearningRateScheduler` and `LearningRateWarmup` install a
`ControlledLearningRate` as the optimizer's learning rate. It is a Keras
`LearningRateSchedule`, evaluated inside the compiled step from the
optimizer's step counter, so changing the rate never recompiles:

- `value`: a replicated variable that epoch-level schedules assign (read in
  the step as state, like any optimizer variable);
- `step_fn`: a traceable schedule of the global step (a Keras
  `LearningRateSchedule` or an optax schedule), evaluated in the step;
- `warmup`: a linear ramp `(start, target, steps)` that overrides both for
  the first `steps` steps.
"""

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_dist._private_api import _access
from keras_dist.strategies._base import strategy_of_model

__all__ = [
    "ControlledLearningRate",
    "controlled",
    "current_learning_rate",
    "plain_learning_rate",
    "release",
]


@keras.saving.register_keras_serializable(package="keras_dist")
class ControlledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Installed only while `fit` runs; saved models see a plain float."""

    def __init__(self, value: keras.Variable):
        self.value = value
        self.step_fn: Callable[[Any], Any] | None = None
        self.warmup: tuple[float, float, int] | None = None

    def __call__(self, step):
        step = jnp.asarray(step, dtype="float32")
        lr = self.value.value if self.step_fn is None else self.step_fn(step)
        lr = jnp.asarray(lr, dtype="float32")
        if self.warmup is not None:
            start, target, steps = self.warmup
            ramp = start + (target - start) * step / max(steps, 1)
            lr = jnp.where(step < steps, ramp, lr)
        return lr

    def get_config(self):
        return {"value": float(np.asarray(self.value.value))}

    @classmethod
    def from_config(cls, config):
        return float(config["value"])  # A loaded optimizer gets a plain rate.


def controlled(model: keras.Model) -> ControlledLearningRate:
    """The optimizer's `ControlledLearningRate`, installed on first use.

    Reuses the optimizer's own learning-rate variable when it has one;
    otherwise (built with a schedule) creates one, on the model's strategy,
    starting at the schedule's current value. The train step is rebuilt once.
    """
    optimizer = model.optimizer
    current = _access.learning_rate_object(optimizer)
    if isinstance(current, ControlledLearningRate):
        return current
    if isinstance(current, keras.Variable):
        variable = current
    else:
        start = float(np.asarray(_evaluate(current, optimizer)))
        with _model_scope(model):
            variable = keras.Variable(
                start,
                name="learning_rate",
                dtype=keras.config.floatx(),
                trainable=False,
            )
        _access.track_variable(optimizer, variable)
    control = ControlledLearningRate(variable)
    _access.set_learning_rate_object(optimizer, control)
    model.make_train_function(force=True)
    return control


def release(model: keras.Model) -> None:
    """Puts a plain learning-rate variable back, holding the last rate used.

    Called when `fit` ends, so the optimizer saves, loads and trains on as
    one built with a float.
    """
    optimizer = model.optimizer
    control = _access.learning_rate_object(optimizer)
    if not isinstance(control, ControlledLearningRate):
        return
    control.value.assign(current_learning_rate(optimizer))
    _access.set_learning_rate_object(optimizer, control.value)
    model.train_function = None


@contextlib.contextmanager
def plain_learning_rate(model: keras.Model):
    """Within: the optimizer's learning rate is its variable (for saving)."""
    optimizer = getattr(model, "optimizer", None)
    control = None if optimizer is None else _access.learning_rate_object(optimizer)
    if optimizer is None or not isinstance(control, ControlledLearningRate):
        yield
        return
    _access.set_learning_rate_object(optimizer, control.value)
    try:
        yield
    finally:
        _access.set_learning_rate_object(optimizer, control)


def _model_scope(model):
    strategy = strategy_of_model(model)
    if strategy is not None and keras.distribution.distribution() is None:
        return strategy.scope()
    return contextlib.nullcontext()


def _evaluate(lr, optimizer, step=None):
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        step = int(np.asarray(optimizer.iterations)) if step is None else step
        return lr(step)
    if isinstance(lr, keras.Variable):
        return lr.value
    if callable(lr):
        return lr()
    return lr


def current_learning_rate(optimizer) -> float:
    """The rate the optimizer used for its most recent step (host float)."""
    iterations = int(np.asarray(optimizer.iterations))
    rate = _access.learning_rate_object(optimizer)
    value = _evaluate(rate, optimizer, max(iterations - 1, 0))
    return float(np.float32(np.asarray(value)))


def check_rate(value, *, what: str) -> float:
    """A learning rate as float; raises for non-numbers, NaN and negatives."""
    try:
        array = np.asarray(value)
        rate = float(array)
    except (TypeError, ValueError):
        raise TypeError(
            f"{what} must return a number. Received: {value!r} of type "
            f"{type(value).__name__}."
        ) from None
    if array.ndim or not np.issubdtype(array.dtype, np.number):
        raise TypeError(f"{what} must return a scalar number. Received: {value!r}.")
    if math.isnan(rate) or rate < 0:
        raise ValueError(
            f"{what} must return a non-negative learning rate. Received: {rate}."
        )
    return rate


def is_traceable(fn) -> bool:
    """Whether `fn(step)` can run inside a compiled step (JAX-traceable)."""
    if isinstance(fn, keras.optimizers.schedules.LearningRateSchedule):
        return True
    try:
        out = jax.eval_shape(
            lambda s: jnp.asarray(fn(s), "float32"),
            jax.ShapeDtypeStruct((), jnp.int32),
        )
    except Exception:
        return False
    return out.shape == ()
