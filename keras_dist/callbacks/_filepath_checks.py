"""`ModelCheckpoint`'s `filepath` and `monitor`, checked before training is lost.

Keras 3.15 formats `filepath` only when it first saves (an unknown key, or
`{val_loss}` without validation data, raises after the first epoch
trained), and a `monitor` that is not logged only warns, each epoch then
saved as "best". The suffix is checked when the callback is made, the
filepath's keys in `on_train_begin` against the keys the logs will hold,
the monitor at the first epoch end against the logs.
"""

import os
import string
from typing import Any

import keras

from keras_dist._checkpoint.keras_files import SUFFIXES
from keras_dist.data import _call

__all__ = [
    "check_filepath_keys",
    "check_monitor",
    "checked_filepath",
    "formats_logs",
]


def checked_filepath(filepath: str, *, weights_only: bool, sharded: bool) -> str:
    """`filepath` with the suffix `save_weights_only` gives a bare prefix
    (`"ckpt_{epoch}"`), or a ValueError naming what it must be."""
    if sharded:
        if "{" in filepath or filepath.endswith(SUFFIXES):
            raise ValueError(
                "With sharded=True, `filepath` is the directory of the "
                "checkpoints (one subdirectory per step): no `{}` keys and "
                f"no file suffix. Received: filepath={filepath!r}."
            )
    elif not filepath.endswith(SUFFIXES) and "." not in os.path.basename(filepath):
        filepath += ".weights.h5" if weights_only else ".keras"
    expected = (".weights.h5",) if weights_only else (".keras", ".h5")
    if not sharded and (
        not filepath.endswith(expected)
        or (not weights_only and filepath.endswith(".weights.h5"))
    ):
        raise ValueError(
            f"`filepath` must end in {' or '.join(expected)} with "
            f"save_weights_only={weights_only}. Received: filepath={filepath!r}."
        )
    return filepath


def formats_logs(filepath: str) -> bool:
    """Whether `filepath` names a log value (`{loss:.2f}`), not only epoch/batch."""
    try:
        keys = _format_keys(filepath)
    except ValueError:  # Keras's own formatting reports it.
        return True
    return any(key not in ("epoch", "batch") for key in keys)


_ALWAYS = ("epoch", "batch", "learning_rate")


def _format_keys(filepath: str) -> list[str]:
    keys = []
    for _, field, _, _ in string.Formatter().parse(filepath):
        if field:
            keys.append(field.split(".")[0].split("[")[0])
    return keys


def _validates() -> bool | None:
    state = _call.active()
    return None if state is None else state.validates


def check_filepath_keys(filepath: str, model: Any) -> None:
    """Raises ValueError if `filepath` names a key the logs will not hold.

    Models with their own `train_step` may log any key: not checked.
    """
    if type(model).train_step is not keras.Model.train_step:
        return
    metrics = list(model.get_metrics_result())
    validates = _validates()
    available = [*_ALWAYS, *metrics]
    if validates is not False:
        available += [f"val_{name}" for name in metrics]
    for key in _format_keys(filepath):
        if key in available or (validates is None and key.startswith("val_")):
            continue
        hint = ""
        if key.startswith("val_") and key[4:] in metrics:
            hint = (
                " Validation keys exist only when `fit` validates: pass "
                "`validation_data=` or `validation_split=`."
            )
        raise ValueError(
            f"ModelCheckpoint's `filepath` uses the key {{{key}}}, which the logs "
            f"of this `fit` will not hold. Received: filepath={filepath!r}. "
            f"Available keys: {available}.{hint} Fix the key, e.g. "
            "'ckpt_{epoch:02d}_{loss:.3f}.keras'."
        )


def check_monitor(monitor: str, logs: dict | None) -> None:
    """Raises ValueError if `monitor` is not in an epoch's `logs`.

    A `val_` key whose training twin is logged is allowed: validation may
    not run every epoch (`validation_freq`).
    """
    if logs is None or monitor in logs:
        return
    if monitor.startswith("val_") and monitor[4:] in logs and _validates():
        return
    raise ValueError(
        f"ModelCheckpoint's `monitor` is not in the logs, so with "
        f"save_best_only=True no epoch can be compared (Keras would save every "
        f"epoch as the best). Received: monitor={monitor!r}. Available keys: "
        f"{sorted(logs)}. Pass one of them, e.g. monitor='loss'"
        + (" or 'val_loss' with validation data." if "loss" in logs else ".")
    )
