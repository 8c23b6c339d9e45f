"""Mistakes in a `fit`/`evaluate`/`predict`/`*_on_batch` call, refused at the call.

Keras 3.15 on JAX lets these through to a confusing failure or a silently
wrong run; the entry-point seam (`_seams/_model.py`) calls `check_call`
before Keras starts, for plain Keras models too (a call that would have
worked is never refused):

- counts that are not ints or are out of range (`epochs="2"`,
  `steps_per_epoch=0`, `batch_size=32.0`, `validation_freq=0`): `check_int`;
- no optimizer (`compile(optimizer=None)` then `fit`: `AttributeError`);
- no rows (`x` of length 0 or a `tf.data` dataset of cardinality 0: a bare
  `StopIteration`, or `UnboundLocalError` from `predict`); empty passes of
  other inputs are refused by the input pipeline under a strategy;
- a `tf.data` dataset of single examples (a scalar component, or components
  whose first dimensions differ: Keras fails on the first element's shape);
- no targets for a loss that needs them, and sparse labels outside the
  model's output (`data/checks/_batch_checks.py`); `class_weight` keys that are no
  class of the output. The returned batch check carries the targets checks
  to every batch the input pipeline reads (datasets, generators).
"""

import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from keras_dist._checks import check_int
from keras_dist.data._tf_data import (
    cardinality,
    is_tf_dataset,
    unbatched_reason,
)
from keras_dist.data.checks._batch_checks import (
    BatchTargets,
    missing_targets_error,
    needs_targets,
    sparse_labels,
)

__all__ = ["check_call"]

# Keras's count arguments: name -> smallest value that means what it says.
_COUNTS = {
    "epochs": 0,
    "initial_epoch": 0,
    "steps_per_epoch": 1,
    "steps": 1,
    "validation_steps": 1,
    "validation_freq": 1,
    "batch_size": 1,
    "validation_batch_size": 1,
}
_TRAINS = ("fit", "train_on_batch")
_HAS_TARGETS = ("fit", "evaluate", "train_on_batch", "test_on_batch")


def check_call(
    method: str, model: Any, arguments: dict
) -> Callable[[Any, int], None] | None:
    """Refuses a call Keras would fail or run wrongly; returns a batch check.

    Args:
        method: `"fit"`, `"evaluate"`, `"predict"`, `"train_on_batch"`, ...
        model: the Keras model called.
        arguments: the call's arguments by name (bound to its signature).

    Returns:
        A check for each batch of the call's input, or None.
    """
    for name, minimum in _COUNTS.items():
        if arguments.get(name) is not None:
            check_int(arguments[name], name=name, minimum=minimum)
    if method in _TRAINS and getattr(model, "compiled", False):
        _check_optimizer(model)
    x = arguments.get("x")
    if method != "predict_on_batch":  # Keras returns [] there, as it should.
        _check_not_empty(x, "x")
        _check_batched(x, "x", method)
        validation = arguments.get("validation_data")
        if isinstance(validation, (tuple, list)) and validation:
            _check_not_empty(validation[0], "validation_data")
        else:
            _check_not_empty(validation, "validation_data")
            _check_batched(validation, "validation_data", method)
    if method not in _HAS_TARGETS:
        return None
    return _check_targets(method, model, x, arguments)


def _check_optimizer(model: Any) -> None:
    if model.optimizer is None:
        raise ValueError(
            "The model was compiled without an optimizer, so it cannot be "
            "trained. Received: optimizer=None in `model.compile`. Compile "
            "with one, e.g. `model.compile(optimizer='adam', loss=...)`; a "
            "model only evaluated or used for predictions needs none."
        )


def _arrays(value: Any) -> list | None:
    """The leaves of NumPy-like input (arrays, lists/dicts of them), else None."""
    if value is None or is_tf_dataset(value):
        return None
    if not isinstance(value, (list, tuple, dict)) and not _is_array(value):
        return None
    leaves = jax.tree.leaves(value)
    return leaves if leaves and all(_is_array(leaf) for leaf in leaves) else None


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and hasattr(value, "shape")


def _check_not_empty(value: Any, name: str) -> None:
    arrays = _arrays(value)
    if arrays is not None:
        rows = arrays[0].shape[0] if len(arrays[0].shape) else None
        if rows == 0:
            raise ValueError(
                f"`{name}` has no rows: there is nothing to run on. Received: "
                f"{name} of shape {tuple(arrays[0].shape)}. Check how it was "
                "built (an empty split, a filter that dropped everything)."
            )
    elif is_tf_dataset(value) and cardinality(value) == 0:
        raise ValueError(
            f"`{name}` is an empty dataset: there is nothing to run on. "
            f"Received: {name}={value!r} (cardinality 0). Check how it was "
            "built (e.g. `take(0)`, a `skip` past its end, or `batch(n, "
            "drop_remainder=True)` with fewer than n examples)."
        )


def _check_batched(value: Any, name: str, method: str) -> None:
    """A `tf.data` dataset of single examples (no `.batch`): said so.

    Keras reads its elements as batches and fails on the first with the
    shape of one example (under a strategy: padded to the replicas).
    """
    if not is_tf_dataset(value):
        return
    reason = unbatched_reason(value)
    if reason is not None:
        raise ValueError(
            f"`{name}` looks unbatched: `{method}` reads a tf.data dataset's "
            f"elements as batches, but {reason}. Received: {name} with "
            f"element_spec={value.element_spec}. Batch it: "
            "`dataset.batch(GLOBAL_BATCH_SIZE)` (under a strategy, the global "
            "batch: it is split over the replicas)."
        )


def _check_targets(method: str, model: Any, x: Any, arguments: dict):
    if not needs_targets(model):
        return None
    y = arguments.get("y")
    if y is None and _arrays(x) is not None:
        raise missing_targets_error(
            model, f"`{method}` was called with `x` only", "y=None"
        )
    labels = sparse_labels(model)
    class_weight = arguments.get("class_weight")
    if labels is not None:
        labels.check_class_weight(class_weight)
        if _arrays(y) is not None:
            labels.check(y, "y")
            _warn_unused_class_weight(class_weight, y)
    return BatchTargets(model, labels, method)


def _warn_unused_class_weight(class_weight: Any, y: Any) -> None:
    """Keras gives unlisted classes weight 1.0, so a key naming a class absent
    from `y` while a class present is unlisted is legal, but likely a slip."""
    if not isinstance(class_weight, dict) or np.ndim(y) > 2:
        return
    present = {int(c) for c in np.unique(np.round(np.asarray(y)).astype("int64"))}
    absent = sorted(set(class_weight) - present)
    unlisted = sorted(present - set(class_weight))
    if absent and unlisted:
        warnings.warn(
            f"`class_weight` names classes {absent} that do not occur in `y`, "
            f"while classes {unlisted} of `y` have no weight (Keras weighs them "
            f"1.0). Received: class_weight={class_weight!r}. If the classes are "
            "numbered differently (e.g. from 1), renumber the keys.",
            UserWarning,
            stacklevel=4,
        )
