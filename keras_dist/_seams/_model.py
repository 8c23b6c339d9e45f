"""Seams 2 and 3: a model runs under its strategy; a failed call leaves it usable."""

import contextlib
import functools
import inspect
from collections.abc import Callable

import jax
import keras

from keras_dist._checks import check_int
from keras_dist._private_api._wrapped import marked
from keras_dist._seams._processes import prepare_call
from keras_dist._seams._trainer import current_strategy
from keras_dist.cluster import _heartbeat, _sync
from keras_dist.data import _call
from keras_dist.errors import StrategyMismatchError
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.state._ownership import (
    model_variables,
    strategy_of_model,
    strategy_of_variable,
)
from keras_dist.training._call_checks import check_call

__all__ = ["_entry_point", "_step_builder"]

_BATCH_ARGS = ("batch_size", "validation_batch_size")
_WITH_CALLBACKS = ("fit", "evaluate", "predict")
_OTHER_STRATEGY_FIX = (
    "Run it under its own strategy (call it outside any `strategy.scope()`: "
    "the model runs where it was built), or, to move it, build and compile a "
    "new model inside the new strategy's scope and copy the weights:\n\n"
    "    with new_strategy.scope():\n"
    "        new_model = make_model()\n"
    "        new_model.compile(...)\n"
    "    new_model.set_weights(model.get_weights())"
)


def _entry_point(method: Callable) -> Callable:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(model, *args, **kwargs):
        strategy = _strategy_for(model)
        if strategy is None:  # Plain Keras; keras_dist callbacks still need it.
            check, validates = _checked(signature, method, model, args, kwargs)
            with _call.enter(
                method.__name__,
                None,
                initial_epoch=_initial_epoch(signature, method, model, args, kwargs),
            ) as state:
                state.check_batch, state.validates = check, validates
                return method(model, *args, **kwargs)
        _check_batch_sizes(signature, strategy, model, args, kwargs)
        check, validates = _checked(signature, method, model, args, kwargs)
        initial_epoch = _initial_epoch(signature, method, model, args, kwargs)
        if strategy.spans_processes:
            bound = signature.bind(model, *args, **kwargs)
            prepare_call(method.__name__, model, bound.arguments)
            args, kwargs = bound.args[1:], bound.kwargs
        _place_variables(model, strategy, move=False)  # Refuse before building.
        with contextlib.ExitStack() as stack:
            state = stack.enter_context(
                _call.enter(method.__name__, strategy, initial_epoch=initial_epoch)
            )
            state.check_batch, state.validates = check, validates
            stack.enter_context(_heartbeat.in_call(method.__name__))  # Progress.
            if keras.distribution.distribution() is None:
                stack.enter_context(strategy.scope())
            snapshot = [(v, v._value) for v in model_variables(model)]
            try:
                result = method(model, *args, **kwargs)
            except BaseException:
                _reattach(model, snapshot)
                raise
        if strategy.spans_processes and method.__name__ in _WITH_CALLBACKS:
            # Every process returns when every process's callbacks have ended
            # the call (the chief's last checkpoint, CSV row, deleted backup),
            # as `model.save` returns when the file is complete: a program
            # reading those files after `fit`, on any process, finds them.
            _sync.allgather(
                f"{method.__name__}-returns",
                None,
                rule="Every process calls fit, evaluate and predict alike.",
            )
        return result

    marked(wrapper, method)
    return wrapper


def _checked(signature, method, model, args, kwargs):
    """Refuses mistakes in the call's arguments.

    Returns:
        The check of its batches (or None) and whether it validates.
    """
    try:
        bound = signature.bind(model, *args, **kwargs).arguments
    except TypeError:
        return None, None  # Keras reports wrong arguments itself.
    validates = bound.get("validation_data") is not None or bool(
        bound.get("validation_split")
    )
    return check_call(method.__name__, model, bound), validates


def _initial_epoch(signature, method, model, args, kwargs) -> int:
    if method.__name__ != "fit":
        return 0
    try:
        bound = signature.bind_partial(model, *args, **kwargs).arguments
    except TypeError:
        return 0  # Keras reports wrong arguments itself.
    return bound.get("initial_epoch", 0)


def _step_builder(method: Callable) -> Callable:
    """Before a step is compiled, every variable must live on the strategy."""

    @functools.wraps(method)
    def wrapper(model, force=False):
        strategy = current_strategy()
        if strategy is not None and _place_variables(model, strategy):
            force = True  # A cached step carries the old placement.
        return method(model, force=force)

    marked(wrapper, method)
    return wrapper


def _strategy_for(model):
    """The current keras_dist strategy, else the one the model was built under."""
    if keras.distribution.distribution() is not None:
        return current_strategy()
    return strategy_of_model(model)


def _check_batch_sizes(signature, strategy: Strategy, model, args, kwargs) -> None:
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return  # Keras reports wrong arguments itself.
    for name in _BATCH_ARGS:
        value = bound.arguments.get(name)
        if value is None:
            continue
        value = check_int(
            value,
            name=name,
            meaning=(
                f": the global batch, split over the "
                f"{strategy.num_replicas_in_sync} replicas of {strategy!r}"
            ),
            example=32 * strategy.num_replicas_in_sync,
        )
        strategy.check_global_batch(value)


def _place_variables(model, strategy: Strategy, *, move: bool = True) -> bool:
    """Moves variables built outside any scope onto `strategy`; refuses others.

    Returns whether a variable was moved (never, with `move=False`).
    """
    moved = False
    for v in model_variables(model):
        if getattr(v, "_value", None) is None:
            continue
        owner = strategy_of_variable(v)
        if owner is not None and owner.devices == strategy.devices:
            continue
        if owner is not None or getattr(v, "_layout", None) is not None:
            where = owner if owner is not None else v._layout
            raise StrategyMismatchError(
                f"Variable {v.path!r} was created under {where!r}, but the model "
                f"is being run under {strategy!r}: a model belongs to the "
                f"strategy it was built in. {_OTHER_STRATEGY_FIX}"
            )
        if not move:
            continue
        v._layout = strategy.get_variable_layout(v)
        v._direct_assign(v._value)
        moved = True
    if moved:  # Compiled steps carry the old placement; rebuild them all.
        model.train_function = model.test_function = model.predict_function = None
    return moved


def _reattach(model, snapshot) -> None:
    """Puts values back on variables that a failed loop left detached."""
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        with contextlib.suppress(Exception):
            model.jax_state_sync()
    model._jax_state = None
    model._jax_state_synced = True
    for v, value in snapshot:
        if v._value is None and value is not None:
            if isinstance(value, jax.Array) and value.is_deleted():
                continue  # Donated to a step that ran; nothing left to restore.
            v._value = value
