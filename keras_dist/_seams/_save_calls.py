"""Seam 13: a model saved by every process is written once, by the chief;
a bucket's file is written and read whole.

`Model.save`, `Model.save_weights`, `keras.saving.save_model` (also
`keras.models.save_model`) and `keras.saving.save_weights`, called on a
model of a keras_dist strategy, go to the save pipeline's
`_checkpoint/pipeline.save_once`: Keras's file committed whole (written
under a temporary name and renamed; on a bucket: a local file uploaded
whole), and with several processes every process takes part, the chief
writes the one file, every process returns when it is complete. `Model.load_weights`,
`keras.saving.load_weights` and `keras.saving.load_model` (also
`keras.models.load_model`) under a keras_dist strategy read a `gs://`/`s3://`
file from a local copy, downloaded whole. The file functions Keras's own
callbacks call on a path (`keras.src.utils.file_utils`: `exists`,
`makedirs`, `File`, `copy`, `rmtree`, ...) take a `gs://`/`s3://` URL
through keras_dist's path layer (`_checkpoint/storage.py`) under a
keras_dist strategy (`BucketGfile`, in place of the `gfile` they call), so
`keras.callbacks.ModelCheckpoint` and `keras.callbacks.BackupAndRestore`
write a bucket as `kd.callbacks`'s do. Anywhere else they are Keras's own (whose only
remote route is TensorFlow's gfile).
"""

import functools
import importlib.util
import inspect
import os
from collections.abc import Callable

import keras

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.pipeline import save_once
from keras_dist._private_api._wrapped import marked
from keras_dist._seams._model import _strategy_for
from keras_dist._seams._trainer import current_strategy

__all__ = ["BucketGfile", "bucket_gfile", "loaded_locally", "saved_once"]


def _on_a_bucket(filepath) -> bool:
    """Whether `filepath` is a URL keras_dist writes (`gs://`, `s3://`) with
    its client installed (without it, Keras's own route: TensorFlow's gfile,
    where TensorFlow is installed)."""
    if not isinstance(filepath, str):
        return False
    served = storage.SERVED_BY.get(storage.scheme(filepath) or "")
    return served is not None and importlib.util.find_spec(served[0]) is not None


def saved_once(*, weights_only: bool, method: str) -> Callable:
    """The wrap of one of Keras's save functions (`method` names it in
    messages), taking the model first and the path second."""

    def wrap(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(model, *args, **kwargs):
            strategy = _strategy_for(model)
            if strategy is None:
                return original(model, *args, **kwargs)
            bound = signature.bind(model, *args, **kwargs)
            arguments = bound.arguments
            filepath = arguments["filepath"]
            if not isinstance(filepath, str | os.PathLike):
                return original(model, *args, **kwargs)  # Keras's own error.
            if _on_a_bucket(filepath):
                filepath = storage.check(filepath, argument="filepath")

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


def loaded_locally(*, takes_model: bool) -> Callable:
    """The wrap of one of Keras's load functions (`takes_model`: the model
    first, the path second; else the path first): a bucket's file read
    from a local copy under a keras_dist strategy."""

    def wrap(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            filepath = bound.arguments.get("filepath")
            if filepath is None or not _on_a_bucket(filepath):
                return original(*args, **kwargs)
            if takes_model:
                model = bound.arguments[next(iter(signature.parameters))]
                strategy = _strategy_for(model)
            elif keras.distribution.distribution() is not None:
                strategy = current_strategy()
            else:
                strategy = None
            if strategy is None:
                return original(*args, **kwargs)
            url = storage.check(filepath, argument="filepath")
            with storage.download(url) as local:
                bound.arguments["filepath"] = local
                return original(*bound.args, **bound.kwargs)

        marked(wrapper, original)
        return wrapper

    return wrap


class BucketGfile:
    """Keras's `file_utils.gfile` (TensorFlow's gfile, imported when first
    used), with a `gs://`/`s3://` URL under a keras_dist strategy taken by
    keras_dist's path layer instead.

    Keras's file functions (`file_utils.exists`, `makedirs`, `File`, `copy`,
    `rmtree`, ...), which its `ModelCheckpoint` and `BackupAndRestore` call,
    send every URL to `gfile` if `gfile.available`. Another URL, or without
    a strategy: TensorFlow's gfile, as in Keras (without TensorFlow, under a
    strategy: the path layer, as the next Keras's etils.epath; without a
    strategy: Keras's own handling).
    """

    def __init__(self, gfile):
        self._gfile = gfile

    @property
    def available(self) -> bool:
        # Keras asks before each call on a URL: under a strategy the call
        # decides (`_route`); else TensorFlow's, as Keras's own.
        return current_strategy() is not None or self._gfile.available

    def _route(self, name: str, path, *args, **kwargs):
        if _on_a_bucket(path) and current_strategy() is not None:
            path = storage.check(path, argument="filepath")
        elif self._gfile.available:
            return getattr(self._gfile, name)(path, *args, **kwargs)
        # A bucket, or (no TensorFlow) another URL fsspec serves: the path
        # layer, on etils.epath as the next Keras does without TensorFlow.
        return _ON_THE_BUCKET[name](path, *args, **kwargs)

    def exists(self, path):
        return self._route("exists", path)

    def isdir(self, path):
        return self._route("isdir", path)

    def makedirs(self, path):
        return self._route("makedirs", path)

    def listdir(self, path):
        return self._route("listdir", path)

    def remove(self, path):
        return self._route("remove", path)

    def rmtree(self, path):
        return self._route("rmtree", path)

    def copy(self, src, dst, overwrite=False):
        return self._route("copy", src, dst, overwrite=overwrite)

    def GFile(self, path, mode="r"):  # gfile's name
        return self._route("GFile", path, mode)

    def join(self, path, *paths):
        return self._route("join", path, *paths)

    def __getattr__(self, name: str):  # Anything else: TensorFlow's.
        return getattr(self._gfile, name)


def _copy(source: str, destination, *, overwrite: bool = False) -> None:
    if not overwrite and storage.exists(destination):
        raise FileExistsError(f"{destination} exists (overwrite=False)")
    storage.copy(source, destination)


# gfile's functions on a bucket, by name: the path layer's.
_ON_THE_BUCKET: dict[str, Callable] = {
    "exists": storage.exists,
    "isdir": storage.isdir,
    "makedirs": lambda path: None,  # A bucket has no folders to make.
    "listdir": storage.listdir,
    "remove": storage.remove,
    "rmtree": storage.rmtree,
    "copy": _copy,
    "GFile": storage.open_file,
    "join": storage.join,
}


def bucket_gfile(original) -> BucketGfile:
    """The seam's wrap of Keras's `file_utils.gfile`."""
    return marked(BucketGfile(original), original)
