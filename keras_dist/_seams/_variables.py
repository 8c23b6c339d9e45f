"""Seams 6 and 8: variables under a strategy, made in parts and read where needed.

**Split variables are created and loaded part by part.** Keras 3.15
(`JaxVariable._initialize_with_initializer`) computes an
initializer's value whole on the default device, then `device_put`s it to the
variable's layout — unless the variable is at least 250 MiB times the mesh size
(`should_shard_at_init`). `KerasVariable.assign` likewise converts a NumPy
value (a loaded checkpoint) to an array on the default device first. Under a
keras_dist strategy, a variable the strategy splits is instead initialized by
the initializer compiled with the variable's sharding as output (each device
computes its part; `strategies/state/_split_values.py`). Replicated variables
keep Keras's initialization (no compilation per variable). An assigned host
value (NumPy, a Python number: a metric's reset) goes from the host straight
to the variable's layout, to its parts when split, in one transfer.

The numbers are Keras's: a Keras initializer's seed is drawn exactly as Keras
draws it (`draw_seed`: an int seed or the next state of a `SeedGenerator`)
and passed to the compiled function, which is therefore shared by every
variable of the same initializer config, shape and sharding. `Zeros`, `Ones`
and a scalar `Constant` need no compilation: each part is filled on the
host. A custom initializer is compiled as it is; if it cannot be traced
(NumPy on its inputs, `float()` of a traced value) or changes a
`SeedGenerator`'s state while traced, Keras's own path runs instead.

**Variables kept in host memory are read where a computation needs them.**
Under a strategy whose variables live outside device memory
(`strategy.state_layout.off_device`, e.g. `CentralStorageStrategy` with its
state in `"pinned_host"` memory), JAX refuses to compute on host and device
arrays together. Keras's steps get their state moved to device memory by
the one step wrapper (`training/_step.py`).

Outside the steps, a variable joins computations directly: Keras traces
code that reads variables (`compute_output_spec` builds the metrics of a
first `fit` with `jax.eval_shape` over the model), a user's `jax.jit(model)`
does too, and eager code computes on them (`model(x)` to check a shape,
`kernel[0]`, `kernel == x` in Keras's loss-scale tests). `variable_value`
wraps `JaxVariable.value` so that a variable stored in host memory is read
in device memory, the memory of the computation it joins — a
`jax.device_put` (traced: a transfer in the program; eager: a copy) —
when JAX traces, or when the reader is one of the Keras functions through
which a variable enters a computation (`joining_functions`: the backend's
`convert_to_tensor` that every op calls, `__jax_array__` for `jax.numpy`,
and the variable's operators). Read directly — `variable.value` by a user,
Keras's trainer collecting a step's state and its shardings, saving — it is
the stored array, where the strategy keeps it.
"""

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from keras.src.backend.common.variables import Variable
from keras.src.initializers.random_initializers import RandomInitializer
from keras.src.random.seed_generator import draw_seed

from keras_dist._private_api import _releases
from keras_dist._private_api._wrapped import marked
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._any_shape import fit_layout
from keras_dist.strategies.devices._lay_out import lay_out, needs_pieces
from keras_dist.strategies.state._ownership import (
    is_strategy,
    newest_strategy_on,
    strategy_of_variable,
)
from keras_dist.strategies.state._split_values import (
    compute_split,
    fill_split,
    put_split,
    split_sharding,
)

_CORE = "keras.src.backend.jax.core"  # The nightly's `ops.core` (`_releases`).

__all__ = [
    "_assign",
    "_direct_assign",
    "_initialize_with_initializer",
    "distribute_tensor",
    "joining_functions",
    "variable_value",
]

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

    marked(wrapper, method)
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
    """A host value (NumPy, a Python number) goes straight to the variable's
    layout: split, to its parts (`put_split`); whole, in one `device_put`.

    Keras would convert it on the default device first, then lay it out
    again (a metric's `reset_state` assigns 0 every epoch; `set_weights`
    assigns NumPy).
    """

    @functools.wraps(method)
    def wrapper(variable, value):
        host = _host_value(variable, value)
        if host is not None and strategy_of_variable(variable) is not None:
            split = split_sharding(variable._layout)
            whole = getattr(variable._layout, "backend_layout", variable._layout)
            if split is not None:
                value = put_split(host, split)
            # Not to host memory (CentralStorage): inside a traced branch (a
            # `StatelessScope` update) the value would then differ in memory
            # space from the other branch's.
            elif isinstance(whole, jax.sharding.NamedSharding) and (
                whole.memory_kind in (None, _DEVICE)
            ):
                if host.shape:
                    value = jax.device_put(host, whole)
                else:  # A scalar: as a cached program's argument (cheaper).
                    value = _scalar_to(whole)(host)
        return method(variable, value)

    marked(wrapper, method)
    return wrapper


@functools.lru_cache(maxsize=64)
def _scalar_to(sharding: jax.sharding.NamedSharding) -> Callable:
    """A program laying a host scalar out as `sharding`.

    A metric's `reset_state` assigns 0 to each of its scalars at every epoch
    and every `evaluate`: a call of a compiled program takes the training
    thread less CPU than `jax.device_put` (measured in commit 0cd5fc4).
    """
    return jax.jit(lambda value: value, out_shardings=sharding)


def _host_value(variable, value) -> np.ndarray | None:
    """`value` as a NumPy array of the variable's shape and dtype, when it is
    one already or a Python number for a scalar variable; else None (Keras
    converts it, and says what is wrong)."""
    if isinstance(value, np.ndarray):
        if value.shape == tuple(variable.shape) and str(value.dtype) == variable._dtype:
            return value
        return None
    if type(value) in (int, float) and not variable.shape:
        return np.asarray(value, dtype=variable._dtype)
    return None


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
        sharding = getattr(variable._layout, "backend_layout", variable._layout)
        if (
            isinstance(sharding, jax.sharding.NamedSharding)
            and current.sharding != sharding
            and strategy_of_variable(variable) is not None
        ):
            variable._value = lay_out(current, sharding)

    marked(wrapper, method)
    return wrapper


# A variable's methods that read its value to inspect or convert it, not to
# compute with it.
_NOT_JOINING = frozenset(
    {"__init__", "__repr__", "__str__", "__array__", "__int__", "__float__"}
)

_DEVICE = "device"


def joining_functions() -> tuple[Callable, ...]:
    """The Keras functions through which a variable's value enters a computation."""
    operators = tuple(
        function
        for name, function in vars(Variable).items()
        if name.startswith("__")
        and name.endswith("__")
        and name not in _NOT_JOINING
        and inspect.isfunction(function)
    )
    return (
        _releases.find(f"{_CORE}.convert_to_tensor"),
        keras.Variable.__jax_array__,
        *operators,
    )


_JOINING = frozenset(function.__code__ for function in joining_functions())


def variable_value(value: property) -> property:
    """`JaxVariable.value`, in device memory where it joins a computation."""
    read = value.fget
    if read is None:
        raise TypeError(
            "keras_dist cannot wrap Keras's `Variable.value`: this Keras version "
            "defines it without a getter. Use a Keras version keras_dist supports "
            "(`keras_dist._seams.CHECKED_KERAS`)."
        )

    @functools.wraps(read)
    def value_for_reader(variable):
        result = read(variable)
        stored = getattr(variable, "_value", None)
        if not isinstance(stored, jax.Array) or isinstance(stored, jax.core.Tracer):
            return result
        kind = getattr(stored.sharding, "memory_kind", None)
        if kind in (_DEVICE, None) or _in_device_memory(result):
            return result
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if not _tracing() and (caller is None or caller.f_code not in _JOINING):
            return result  # Read as stored: by a user, the trainer, saving.
        # Also a traced read (its autocast included): a transfer in the program.
        return jax.device_put(result, stored.sharding.with_memory_kind(_DEVICE))

    marked(value_for_reader, read)
    return property(value_for_reader, value.fset, value.fdel, value.__doc__)


def _tracing() -> bool:
    """Whether JAX is tracing here (a new array is then a tracer)."""
    return isinstance(jax.numpy.ones(()), jax.core.Tracer)


def _in_device_memory(value) -> bool:
    """A concrete array already in device memory (e.g. a stateless scope's)."""
    if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
        return False
    return getattr(value.sharding, "memory_kind", None) in (_DEVICE, None)


def distribute_tensor(original: Callable) -> Callable:
    """Keras's JAX `distribute_tensor`, with the layout fitted to the tensor.

    Keras lays variables, layer outputs (`get_tensor_layout`: a path, no
    shape) and libraries' tensors (keras-hub's `generate`) out through it.
    Inside a compiled function JAX pads an uneven split, but eagerly Keras's
    `jax.device_put` raises on a dimension the mesh axes do not divide.
    While a keras_dist strategy is current, such a layout is fitted to the
    tensor's shape first (`strategies/devices/_any_shape.fit_layout`: the
    dimension kept whole); a layout that fits (every variable's) is passed
    on as it is. An array of this process bound for a layout over several
    processes (a new variable's initial value, an assigned array, a
    library's tensor) is laid out by `strategies/devices/_lay_out.lay_out`,
    which JAX's `device_put` cannot do with one device a process. Without a
    strategy, Keras's own.
    """

    def wrapper(tensor: Any, layout: Any) -> Any:
        current = isinstance(keras.distribution.distribution(), Strategy)
        if (
            current
            and isinstance(layout, keras.distribution.TensorLayout)
            and layout.device_mesh is not None
        ):
            shape = np.shape(tensor)
            if not _fits(layout, shape):
                layout = fit_layout(layout, shape)
        sharding = getattr(layout, "backend_layout", layout)
        # (A strategy's layout outside its scope too: an optimizer built
        # after the scope was left gets its slots laid out by the strategy.)
        if (
            not getattr(sharding, "is_fully_addressable", True)  # Several processes.
            and needs_pieces(tensor, sharding)
            and (current or newest_strategy_on(getattr(sharding, "mesh", None)))
        ):
            return lay_out(tensor, sharding)
        return original(tensor, layout)

    marked(wrapper, original)
    return wrapper


def _fits(layout: Any, shape: tuple) -> bool:
    if len(layout.axes) > len(shape):
        return False
    try:
        layout.backend_layout.shard_shape(shape)
    except ValueError:  # JAX's IndivisibleError.
        return False
    return True
