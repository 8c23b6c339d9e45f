"""Keras's per-step loop without the work that has no effect, under a strategy.

At every step, Keras's JAX loops (`fit`, `evaluate`, `predict`) do two
things a small model pays for and that change nothing:

1. `self._jax_state = {...}` (the state between steps) goes through
   `Layer.__setattr__`, which wraps the dict and each of its lists in Keras's
   tracking proxies and tests every array against the tracked types: work
   that grows with the number of variables, for a dict that never holds a
   variable. Under a keras_dist strategy the dict is stored as it is
   (`_layer_setattr`). Keras reads it back with `.get` either way.
2. `callbacks.on_*_batch_begin/end(step, logs)` runs (or, for `end`, submits
   to a thread pool) a call that turns every log into a Python number,
   waiting for the step, and then calls each callback's hook. When no
   callback overrides the hook (`keras.callbacks.Callback`'s are no-ops,
   marked `@default`), keras_dist skips the call (`_batch_hook`): nothing
   would have read the logs. A callback that overrides it, `ProgbarLogger`
   when `verbose` is not 0, or an object that is not a Keras `Callback`
   gets Keras's own call.

With no keras_dist strategy current, both behave exactly as Keras's.
"""

import weakref
from collections.abc import Callable
from typing import Any

import keras
from keras.src.backend.config import is_nnx_enabled
from keras.src.utils.python_utils import is_default

from keras_dist._keras_compat._input import current_strategy

__all__ = ["BATCH_HOOKS", "_batch_hook", "_layer_setattr"]

# `CallbackList` method -> the `Callback` hooks it calls (Keras's default
# `on_train_batch_*` also calls the legacy `on_batch_*` alias).
BATCH_HOOKS: dict[str, tuple[str, ...]] = {
    "on_train_batch_begin": ("on_train_batch_begin", "on_batch_begin"),
    "on_train_batch_end": ("on_train_batch_end", "on_batch_end"),
    "on_test_batch_begin": ("on_test_batch_begin",),
    "on_test_batch_end": ("on_test_batch_end",),
    "on_predict_batch_begin": ("on_predict_batch_begin",),
    "on_predict_batch_end": ("on_predict_batch_end",),
}


def _layer_setattr(original: Callable) -> Callable:
    """`Layer.__setattr__`, storing the loop's `_jax_state` untracked."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name == "_jax_state"
            and current_strategy() is not None
            and not is_nnx_enabled()
        ):
            object.__setattr__(self, name, value)
            return
        original(self, name, value)

    return __setattr__


# CallbackList -> {hook name: (what the decision was made for, skip?)}: a
# list's callbacks are asked once a call, not at every step.
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _batch_hook(name: str) -> Callable[[Callable], Callable]:
    """A wrapper for `CallbackList.<name>` that skips it when it does nothing."""
    hooks = BATCH_HOOKS[name]

    def wrap(original: Callable) -> Callable:
        def hook(self, batch, logs=None):
            key = (keras.distribution.distribution(), tuple(map(id, self.callbacks)))
            decisions = _DECISIONS.setdefault(self, {})
            known = decisions.get(name)
            if known is None or known[0] != key:
                skip = current_strategy() is not None and not any(
                    _overrides(callback, hooks) for callback in self.callbacks
                )
                known = decisions[name] = (key, skip)
            if known[1]:
                return None
            return original(self, batch, logs)

        hook.__name__ = hook.__qualname__ = name
        return hook

    return wrap


def _overrides(callback: Any, hooks: tuple[str, ...]) -> bool:
    return not all(is_default(getattr(callback, hook, None)) for hook in hooks)
