"""Seam 8: variables kept in host memory, read where a computation needs them.

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

import functools
import inspect
from collections.abc import Callable

import jax
from keras.src.backend.common.variables import Variable
from keras.src.backend.jax import core
from keras.src.utils.jax_utils import is_in_jax_tracing_scope

__all__ = ["joining_functions", "variable_value"]

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
    return (core.convert_to_tensor, core.JaxVariable.__jax_array__, *operators)


_JOINING = frozenset(function.__code__ for function in joining_functions())


def variable_value(value: property) -> property:
    """`JaxVariable.value`, in device memory where it joins a computation."""
    read = value.fget

    @functools.wraps(read)
    def value_for_reader(variable):
        result = read(variable)
        stored = getattr(variable, "_value", None)
        if not isinstance(stored, jax.Array) or isinstance(stored, jax.core.Tracer):
            return result
        kind = getattr(stored.sharding, "memory_kind", None)
        if kind in (_DEVICE, None) or _in_device_memory(result):
            return result
        caller = inspect.currentframe().f_back
        if not is_in_jax_tracing_scope() and caller.f_code not in _JOINING:
            return result  # Read as stored: by a user, the trainer, saving.
        # Also a traced read (its autocast included): a transfer in the program.
        return jax.device_put(result, stored.sharding.with_memory_kind(_DEVICE))

    value_for_reader._keras_dist_wrapped = read
    return property(value_for_reader, value.fset, value.fdel, value.__doc__)


def _in_device_memory(value) -> bool:
    """A concrete array already in device memory (e.g. a stateless scope's)."""
    if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
        return False
    return getattr(value.sharding, "memory_kind", None) in (_DEVICE, None)
