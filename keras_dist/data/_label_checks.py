"""Targets a model's loss cannot use: missing, or class indices out of range.

Two mistakes Keras 3 on JAX does not report:

- **Sparse labels outside the model's output.** `SparseCategoricalCrossentropy`
  (and `sparse_categorical_accuracy`, `sparse_top_k_categorical_accuracy`)
  take class indices in `[0, units)`. JAX one-hot-encodes an index outside
  that range as all zeros: the loss is exactly 0.0, nothing is learned, no
  error (TensorFlow raises here). Labels are compared with the width of the
  model's output: NumPy targets all at the call, batches of other inputs as
  the input pipeline reads them (no extra pass over the data). A loss's
  `ignore_class` is allowed.
- **No targets for a loss that needs them.** `fit(x)` with a compiled loss
  fails inside the step (`None is not a valid value for jnp.array`). Models
  that compute their own loss (`compute_loss` or `train_step` overridden, or
  `loss=None` with `add_loss`) need no targets and are not checked.
"""

from typing import Any

import keras
import numpy as np

__all__ = ["SparseLabels", "missing_targets_error", "needs_targets", "sparse_labels"]

_SPARSE_NAMES = (
    "sparse_categorical_crossentropy",
    "sparse_categorical_accuracy",
    "sparse_top_k_categorical_accuracy",
)
_SPARSE_CLASSES = (
    "SparseCategoricalCrossentropy",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
)


def needs_targets(model: Any) -> bool:
    """Whether `model`'s compiled loss reads targets (`y`)."""
    cls = type(model)
    return (
        getattr(model, "loss", None) is not None
        and getattr(cls, "compute_loss", None) is keras.Model.compute_loss
        and getattr(cls, "train_step", None) is keras.Model.train_step
        and getattr(cls, "test_step", None) is keras.Model.test_step
    )


def missing_targets_error(model: Any, where: str, received: str) -> ValueError:
    loss = _describe_loss(getattr(model, "loss", None))
    return ValueError(
        f"The model's loss {loss} compares predictions with targets, but "
        f"{where}. Received: {received}. Pass targets, "
        "`model.fit(x, y)` or a dataset of `(x, y)` pairs; or compile without a "
        "loss (`loss=None`) if the model adds its own with `add_loss`."
    )


def _describe_loss(loss: Any) -> str:
    if isinstance(loss, str):
        return repr(loss)
    return repr(getattr(loss, "name", None) or getattr(loss, "__name__", loss))


class SparseLabels:
    """Checks class indices against the width of a model's output.

    Args:
        width: units of the model's (single) output: valid labels are
            `0 .. width - 1`.
        names: the sparse losses and metrics that read the labels.
        ignore_class: a label value the loss skips, if any.
    """

    def __init__(self, width: int, names: list[str], ignore_class: int | None):
        self.width = width
        self.names = names
        self.ignore_class = ignore_class

    def check(self, y: Any, where: str) -> None:
        """Raises ValueError if `y` (from `where`) holds an index out of range."""
        labels = np.asarray(y)
        if labels.size == 0 or not np.issubdtype(labels.dtype, np.number):
            return
        if self.ignore_class is not None:
            labels = labels[labels != self.ignore_class]
            if labels.size == 0:
                return
        low, high = labels.min(), labels.max()
        if low >= 0 and high < self.width:
            return
        bad = np.unique(labels[(labels < 0) | (labels >= self.width)])[:5]
        raise ValueError(
            f"The labels of {' and '.join(map(repr, self.names))} must be class "
            f"indices in [0, {self.width}): the model's output has {self.width} "
            f"units. Received: {where} with labels from {_num(low)} to "
            f"{_num(high)} (outside the range: {[_num(v) for v in bad]}). On JAX "
            "an out-of-range label is one-hot-encoded as all zeros: the loss "
            f"is 0.0 and nothing is learned. Give the last layer one unit per "
            f"class (e.g. `Dense({max(int(high) + 1, self.width)})`) or map the "
            f"labels to 0..{self.width - 1}."
        )

    def check_class_weight(self, class_weight: Any) -> None:
        """Raises ValueError for a `class_weight` key that is no output class."""
        if not isinstance(class_weight, dict):
            return
        for key in class_weight:
            if not _is_index(key) or not 0 <= key < self.width:
                raise ValueError(
                    "The keys of `class_weight` must be class indices of the "
                    f"model's output, 0..{self.width - 1}. Received: "
                    f"class_weight={class_weight!r} (key {key!r}). Keras weighs "
                    "each sample by `class_weight[label]` (1.0 for classes not "
                    "listed), so this key never applies: fix the class index."
                )


def _is_index(key: Any) -> bool:
    return isinstance(key, (int, np.integer)) and not isinstance(key, bool)


def _num(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return int(value) if float(value).is_integer() else value


def sparse_labels(model: Any) -> SparseLabels | None:
    """A `SparseLabels` for `model` if a sparse loss or metric reads its one
    output and that output's width is known (a built functional model)."""
    names, ignore_class = _sparse_names(model)
    width = _output_width(model) if names else None
    if width is None:
        return None
    return SparseLabels(width, names, ignore_class)


def _sparse_names(model: Any) -> tuple[list[str], int | None]:
    loss = getattr(model, "loss", None)
    names, ignore_class = [], None
    if _is_sparse(loss):
        names.append(_name(loss))
        ignore_class = _ignore_class(loss)
    config = model.get_compile_config() if getattr(model, "compiled", False) else None
    for metric in (config or {}).get("metrics") or []:
        if _is_sparse(metric):
            names.append(_name(metric))
    return list(dict.fromkeys(names)), ignore_class


def _ignore_class(loss: Any) -> int | None:
    """The `ignore_class` of a sparse loss: from its config (Keras 3.16 keeps
    it in the wrapped function's arguments, 3.15 also as an attribute)."""
    get_config = getattr(loss, "get_config", None)
    if callable(get_config):
        try:
            return get_config().get("ignore_class")
        except (NotImplementedError, TypeError):
            pass
    return getattr(loss, "ignore_class", None)


def _is_sparse(item: Any) -> bool:
    if isinstance(item, dict):  # A serialized metric.
        return item.get("class_name") in _SPARSE_CLASSES
    if type(item).__name__ in _SPARSE_CLASSES:
        return True
    fn = getattr(item, "fn", item)
    return _name(fn) in _SPARSE_NAMES


def _name(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        return item.get("config", {}).get("name") or item.get("class_name")
    return getattr(item, "name", None) or getattr(item, "__name__", repr(item))


def _output_width(model: Any) -> int | None:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # Subclassed: no symbolic outputs.
        return None
    if not isinstance(outputs, (list, tuple)) or len(outputs) != 1:
        return None
    shape = getattr(outputs[0], "shape", None)
    if not shape or shape[-1] is None:
        return None
    return int(shape[-1])
