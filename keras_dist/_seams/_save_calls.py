"""Seam 13: a model saved by every process is written once, by the chief.

`Model.save`, `Model.save_weights`, `keras.saving.save_model` (also
`keras.models.save_model`) and `keras.saving.save_weights`, called on a
model of a keras_dist strategy whose mesh spans processes, go to the save
pipeline's `_checkpoint/keras_files.save_once`: every process takes part,
the chief writes one complete file, every process returns when it is
complete. Anywhere else they are Keras's own.
"""

import functools
import inspect
from collections.abc import Callable

from keras_dist._checkpoint.keras_files import save_once
from keras_dist._private_api._wrapped import marked
from keras_dist._seams._model import _strategy_for

__all__ = ["saved_once"]


def saved_once(*, weights_only: bool, method: str) -> Callable:
    """The wrap of one of Keras's save functions (`method` names it in
    messages), taking the model first and the path second."""

    def wrap(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(model, *args, **kwargs):
            strategy = _strategy_for(model)
            if strategy is None or not strategy.spans_processes:
                return original(model, *args, **kwargs)
            bound = signature.bind(model, *args, **kwargs)
            arguments = bound.arguments
            filepath = arguments["filepath"]

            def save(path: str) -> None:
                arguments["filepath"] = path
                original(*bound.args, **bound.kwargs)

            extra = arguments.get("kwargs") or {}
            snapshot_format = not extra and (
                arguments.get("max_shard_size") is None
                if weights_only
                else arguments.get("zipped") in (None, True)
            )
            save_once(
                model,
                filepath,
                save,
                weights_only=weights_only,
                method=method,
                overwrite=bool(arguments.get("overwrite", True)),
                snapshot_format=snapshot_format,
            )

        marked(wrapper, original)
        return wrapper

    return wrap
