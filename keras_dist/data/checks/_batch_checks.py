"""What each batch of a pass is checked for, as the input pipeline reads it.

**Its form** (`BatchSignature`): batches of one pass keep the structure,
rank and dtype of the first one.

**Its targets** (`BatchTargets`, `SparseLabels`), against the model's loss:
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

The checks of the call itself (`training/_call_checks.py`) make the
`BatchTargets` the pipeline runs on each batch (`CallState.check_batch`).
"""

from typing import Any

import jax
import keras
import numpy as np

from keras_dist._private_api._access import (
    compile_arguments,
    loss_function_arguments,
)

__all__ = [
    "BatchSignature",
    "BatchTargets",
    "SparseLabels",
    "missing_targets_error",
    "needs_targets",
    "sparse_labels",
]


def _describe(leaf) -> tuple:
    return (np.ndim(leaf), np.dtype(getattr(leaf, "dtype", type(leaf))).name)


class BatchSignature:
    """Remembers the first batch of a pass; refuses batches that differ.

    The batch size may change (a partial last batch) and so may the other
    dimensions (each new shape compiles a new step); a change of structure,
    rank or dtype mid-pass is a bug in the input pipeline and would otherwise
    surface as an opaque error from inside the compiled step.

    Args:
        source: what produces the batches, for error messages.
    """

    def __init__(self, source: str):
        self._source = source
        self._key: tuple[jax.tree_util.PyTreeDef, tuple] | None = None
        self._first: tuple = ()  # The first batch's `_signature`.

    def check(self, batch: Any, index: int) -> None:
        """Raises ValueError if `batch` (the `index`-th) differs from the first."""
        # Runs for every batch: compare a cheap key; describe only on mismatch.
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple(_describe(leaf) for leaf in leaves))
        if self._key is None:
            self._key, self._first = key, self._signature(batch)
            return
        if key != self._key:
            self._explain(self._signature(batch), index)

    @staticmethod
    def _signature(batch: Any) -> tuple:
        paths = jax.tree_util.tree_flatten_with_path(batch)[0]
        return tuple(
            (jax.tree_util.keystr(path), *_describe(leaf), np.shape(leaf))
            for path, leaf in paths
        )

    def _explain(self, signature: tuple, index: int) -> None:
        first_keys = [s[:3] for s in self._first]
        keys = [s[:3] for s in signature]
        if first_keys == keys:
            return
        first = {s[0]: s for s in self._first}
        for entry in signature:
            old = first.get(entry[0])
            if old is None or old[1:3] != entry[1:3]:
                was = "absent" if old is None else f"shape {old[3]}, dtype {old[2]}"
                raise ValueError(
                    f"Batch {index} of {self._source} does not match batch 0: "
                    f"element {entry[0] or '(the batch)'} has shape {entry[3]} and "
                    f"dtype {entry[2]}, but was {was} in batch 0. Every batch of an "
                    "epoch must have the same structure, rank and dtype; make "
                    "the dataset yield uniform batches (pad or cast them)."
                )
        raise ValueError(
            f"Batch {index} of {self._source} does not match batch 0: its "
            f"elements are {[k[0] for k in keys]}, batch 0 had "
            f"{[k[0] for k in first_keys]}. Every batch of an epoch must have "
            "the same structure."
        )


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
    for metric in compile_arguments(model).get("metrics") or []:
        if _is_sparse(metric):
            names.append(_name(metric))
    return list(dict.fromkeys(names)), ignore_class


def _ignore_class(loss: Any) -> int | None:
    """The `ignore_class` of a sparse loss: Keras 3.15 keeps it as an
    attribute, 3.16 only in the arguments the loss passes its function (its
    `get_config()` serializes the function too, which imports TensorFlow)."""
    if hasattr(loss, "ignore_class"):
        return loss.ignore_class
    arguments = loss_function_arguments(loss)
    if "ignore_class" in arguments:
        return arguments["ignore_class"]
    get_config = getattr(loss, "get_config", None)
    if callable(get_config):  # Another loss class.
        try:
            return get_config().get("ignore_class")
        except (NotImplementedError, TypeError):
            pass
    return None


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
        return str(item.get("config", {}).get("name") or item.get("class_name"))
    return str(getattr(item, "name", None) or getattr(item, "__name__", repr(item)))


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


class BatchTargets:
    """The targets checks, on each batch the input pipeline reads.

    Args:
        model: the model called (its loss names the error).
        labels: the sparse-label check of its output, if any.
        method: the call (`"fit"`, `"evaluate"`, ...), for the error.
    """

    def __init__(self, model: Any, labels: SparseLabels | None, method: str):
        self._model = model
        self._labels = labels
        self._method = method

    def __call__(self, batch: Any, index: int) -> None:
        y = batch[1] if isinstance(batch, tuple) and len(batch) > 1 else None
        if y is None and index == 0:
            raise missing_targets_error(
                self._model,
                f"the first batch of `{self._method}`'s input holds none",
                "batches of x only (no targets)",
            )
        if self._labels is not None and _is_array(y):
            self._labels.check(y, f"batch {index} of the input, y")


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and hasattr(value, "shape")
