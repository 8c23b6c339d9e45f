"""Seam 6: split variables are created and loaded part by part.

Keras 3.15 (`JaxVariable._initialize_with_initializer`) computes an
initializer's value whole on the default device, then `device_put`s it to the
variable's layout — unless the variable is at least 250 MiB times the mesh size
(`should_shard_at_init`). `KerasVariable.assign` likewise converts a NumPy
value (a loaded checkpoint) to an array on the default device first. Under a
keras_dist strategy, a variable the strategy splits is instead initialized by
the initializer compiled with the variable's sharding as output (each device
computes its part; `strategies/_split_values.py`) and assigned NumPy values
go from the host straight to their parts. Replicated variables keep Keras's
path (no compilation per variable).

The numbers are Keras's: a Keras initializer's seed is drawn exactly as Keras
draws it (`draw_seed`: an int seed or the next state of a `SeedGenerator`)
and passed to the compiled function, which is therefore shared by every
variable of the same initializer config, shape and sharding. `Zeros`, `Ones`
and a scalar `Constant` need no compilation: each part is filled on the
host. A custom initializer is compiled as it is; if it cannot be traced
(NumPy on its inputs, `float()` of a traced value) or changes a
`SeedGenerator`'s state while traced, Keras's own path runs instead.
"""

import copy
import functools
import inspect
from collections.abc import Callable

import jax
import keras
import numpy as np
from keras.src.initializers.random_initializers import RandomInitializer
from keras.src.random.seed_generator import draw_seed

from keras_dist.strategies._ownership import is_strategy, strategy_of_variable
from keras_dist.strategies._split_values import (
    compute_split,
    fill_split,
    put_split,
    split_sharding,
)

__all__ = ["_assign", "_initialize_with_initializer"]

# What JAX raises when traced code needs a concrete value.
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _initialize_with_initializer(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(variable, initializer):
        if is_strategy(keras.distribution.distribution()):
            variable._initialize_layout()
            sharding = split_sharding(variable._layout)
            if (
                sharding is not None
                and "layout" not in inspect.signature(initializer).parameters
            ):
                value = _split_initial_value(
                    initializer, variable._shape, variable._dtype, sharding
                )
                if value is not None:
                    variable._value = value
                    return None
        return method(variable, initializer)

    wrapper._keras_dist_wrapped = method
    return wrapper


def _split_initial_value(initializer, shape, dtype, sharding) -> jax.Array | None:
    """The initial value computed part by part; None: use Keras's path."""
    if not _is_keras_initializer(initializer):
        return _custom_initial_value(initializer, shape, dtype, sharding)
    fill_value = _constant(initializer)
    if fill_value is not None:
        return fill_split(fill_value, shape, dtype, sharding)
    key = _cache_key(initializer, shape, dtype)
    if not isinstance(initializer, RandomInitializer):
        return compute_split(
            lambda: initializer(shape, dtype=dtype), (), sharding, cache_key=key
        )

    def seeded(seed):
        clone = copy.copy(initializer)
        clone.seed = seed  # Keras's JAX random ops take a seed array as is.
        return clone(shape, dtype=dtype)

    seed = np.asarray(draw_seed(initializer.seed))
    return compute_split(seeded, (seed,), sharding, cache_key=key)


def _constant(initializer) -> float | None:
    """The one value a `Zeros`, `Ones` or scalar `Constant` fills with."""
    if type(initializer) is keras.initializers.Zeros:
        return 0
    if type(initializer) is keras.initializers.Ones:
        return 1
    if (
        type(initializer) is keras.initializers.Constant
        and np.ndim(initializer.value) == 0
    ):
        return initializer.value
    return None


def _custom_initial_value(initializer, shape, dtype, sharding) -> jax.Array | None:
    # initialize_variables=False: leaving the scope must not initialize
    # variables other code deferred.
    with keras.StatelessScope(initialize_variables=False) as scope:
        try:
            value = compute_split(lambda: initializer(shape, dtype=dtype), (), sharding)
        except _TRACER_ERRORS:
            return None
    if scope.state_mapping:  # It advanced a SeedGenerator: Keras must do it.
        return None
    return value


def _is_keras_initializer(initializer) -> bool:
    return isinstance(initializer, keras.initializers.Initializer) and type(
        initializer
    ).__module__.startswith("keras.")


def _cache_key(initializer, shape, dtype):
    """The initializer's type, config (without the seed), shape and dtype;
    None when the config cannot be a key (e.g. a `Constant` of an array)."""
    config = {k: v for k, v in initializer.get_config().items() if k != "seed"}
    key = (type(initializer), tuple(sorted(config.items())), tuple(shape), dtype)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _assign(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(variable, value):
        if (
            isinstance(value, np.ndarray)
            and value.shape == tuple(variable.shape)
            and str(value.dtype) == variable._dtype
            and strategy_of_variable(variable) is not None
        ):
            sharding = split_sharding(variable._layout)
            if sharding is not None:
                value = put_split(value, sharding)
        return method(variable, value)

    wrapper._keras_dist_wrapped = method
    return wrapper


def _direct_assign(method: Callable) -> Callable:
    """A value laid out by a strategy keeps the strategy's `NamedSharding`.

    Keras skips the layout of a value whose sharding is merely equivalent:
    on a one-device mesh a value on that device stays a `SingleDeviceSharding`
    array, while the compiled step returns `NamedSharding` arrays (another
    abstract type for `jax.jit`): each step would compile again after every
    eager assignment (initial values, metric resets).
    """

    @functools.wraps(method)
    def wrapper(variable, value):
        method(variable, value)
        current = variable._value
        if not isinstance(current, jax.Array) or isinstance(current, jax.core.Tracer):
            return
        if strategy_of_variable(variable) is None:
            return
        sharding = getattr(variable._layout, "backend_layout", variable._layout)
        if (
            isinstance(sharding, jax.sharding.NamedSharding)
            and current.sharding != sharding
        ):
            variable._value = jax.device_put(current, sharding)

    wrapper._keras_dist_wrapped = method
    return wrapper
