"""Seam 8: a step's state brought to device memory (state kept in host memory).

Under a strategy whose variables live outside device memory
(`Strategy._state_off_device()`, e.g. `CentralStorageStrategy` with its state
in `"pinned_host"` memory), Keras's JAX trainer hands each step the
variables' host arrays, and JAX refuses to compute on host and device arrays
together. Both wrappers move the state with the strategy's
`_state_to_compute` at the top of the step:

- `compiled_step`, for the steps Keras compiles with `jit(step,
  donate_argnums=0, out_shardings=<the variables' shardings>)`: the move is
  the first operation of the compiled program, and Keras's `out_shardings`
  (the variables' own, host memory) write the new state back to host memory
  as the step's outputs. The donated state argument and the state outputs
  are both in host memory, so donation keeps working (donating across memory
  kinds fails with "Memory kind mismatch").
- `eager_step`, for `run_eagerly=True` and `jit_compile=False`: the same move
  with eager `jax.device_put`s, and the new state moved back with
  `_state_to_storage`.

Outside the steps, Keras also traces code that reads variables directly
(`compute_output_spec` builds the metrics of a first `fit` with
`jax.eval_shape` over the model), as does a user's `jax.jit(model)`:
`variable_value` wraps `JaxVariable.value` so that, while JAX traces, a
variable stored in host memory is read through a `jax.device_put` to device
memory (a transfer in the traced program). Read eagerly, `variable.value` is
the stored host array itself.
"""

import functools
from collections.abc import Callable

import jax
from keras.src.utils.jax_utils import is_in_jax_tracing_scope

from keras_dist.strategies._base import Strategy

__all__ = ["compiled_step", "eager_step", "variable_value"]

_DEVICE = "device"


def compiled_step(step: Callable, strategy: Strategy) -> Callable:
    """`step(state, *rest)`, to be jitted, computing on the state in device memory."""

    @functools.wraps(step)
    def on_device(state, *args, **kwargs):
        moved = strategy._state_to_compute(state)
        outputs, new_state = step(moved, *args, **kwargs)
        return outputs, _unchanged_as_stored(new_state, moved, state)

    return on_device


def eager_step(step: Callable, strategy: Strategy) -> Callable:
    """`step(state, *rest)` run eagerly: state to device, new state back to storage."""

    @functools.wraps(step)
    def on_device(state, *args, **kwargs):
        moved = strategy._state_to_compute(state)
        outputs, new_state = step(moved, *args, **kwargs)
        new_state = _unchanged_as_stored(new_state, moved, state)
        stored = {id(leaf) for leaf in jax.tree.leaves(state)}
        return outputs, jax.tree.map(
            lambda x: x if id(x) in stored else strategy._state_to_storage(x),
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


def variable_value(value: property) -> property:
    """`JaxVariable.value`, read in device memory while JAX traces."""
    read = value.fget

    @functools.wraps(read)
    def on_device_when_traced(variable):
        result = read(variable)
        stored = getattr(variable, "_value", None)
        kind = getattr(getattr(stored, "sharding", None), "memory_kind", _DEVICE)
        if kind in (_DEVICE, None) or isinstance(stored, jax.core.Tracer):
            return result
        if not is_in_jax_tracing_scope():
            return result
        return jax.device_put(result, stored.sharding.with_memory_kind(_DEVICE))

    on_device_when_traced._keras_dist_wrapped = read
    return property(on_device_when_traced, value.fset, value.fdel, value.__doc__)
