"""Seam 8: a step's state brought to device memory (state kept in host memory).

Under a strategy whose variables live outside device memory
(`strategy.state_layout.off_device`, e.g. `CentralStorageStrategy` with its state
in `"pinned_host"` memory), Keras's JAX trainer hands each step the
variables' host arrays, and JAX refuses to compute on host and device arrays
together. Both wrappers move the state with the strategy's
`state_layout.to_compute` at the top of the step:

- `compiled_step`, for the steps Keras compiles with `jit(step,
  donate_argnums=0, out_shardings=<the variables' shardings>)`: the move is
  the first operation of the compiled program, and Keras's `out_shardings`
  (the variables' own, host memory) write the new state back to host memory
  as the step's outputs. The donated state argument and the state outputs
  are both in host memory, so donation keeps working (donating across memory
  kinds fails with "Memory kind mismatch").
- `eager_step`, for `run_eagerly=True` and `jit_compile=False`: the same move
  with eager `jax.device_put`s, and the new state moved back with
  `state_layout.to_storage`.

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

from keras_dist.strategies._base import Strategy

__all__ = ["compiled_step", "eager_step", "joining_functions", "variable_value"]

# A variable's methods that read its value to inspect or convert it, not to
# compute with it.
_NOT_JOINING = frozenset(
    {"__init__", "__repr__", "__str__", "__array__", "__int__", "__float__"}
)

_DEVICE = "device"


def compiled_step(step: Callable, strategy: Strategy) -> Callable:
    """`step(state, *rest)`, to be jitted, computing on the state in device memory."""

    @functools.wraps(step)
    def on_device(state, *args, **kwargs):
        moved = strategy.state_layout.to_compute(state)
        outputs, new_state = step(moved, *args, **kwargs)
        return outputs, _unchanged_as_stored(new_state, moved, state)

    return on_device


def eager_step(step: Callable, strategy: Strategy) -> Callable:
    """`step(state, *rest)` run eagerly: state to device, new state back to storage."""

    @functools.wraps(step)
    def on_device(state, *args, **kwargs):
        moved = strategy.state_layout.to_compute(state)
        outputs, new_state = step(moved, *args, **kwargs)
        new_state = _unchanged_as_stored(new_state, moved, state)
        stored = {id(leaf) for leaf in jax.tree.leaves(state)}
        return outputs, jax.tree.map(
            lambda x: x if id(x) in stored else strategy.state_layout.to_storage(x),
            new_state,
        )

    return on_device


def _unchanged_as_stored(new_state, moved, stored):
    """`new_state` with each value the step did not change given back as stored.

    Weights an evaluate or predict step returns untouched then cost no copy
    back to host memory (compiled, the output aliases the donated input).
    """
    back = dict(
        zip(map(id, jax.tree.leaves(moved)), jax.tree.leaves(stored), strict=True)
    )
    return jax.tree.map(lambda x: back.get(id(x), x), new_state)


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
