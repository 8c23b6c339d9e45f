"""Where checkpoints go: one path layer for local folders and buckets.

Every file and folder operation of the checkpoint engine and of the
callbacks goes through here, on `etils.epath`'s backends (Orbax's path
layer): the OS's for a local path, fsspec's for `gs://` (gcsfs) and
`s3://` (s3fs). A URL is never handed to `os.path` or `open`: `check`
refuses a scheme no installed library serves, at construction.

A file on a bucket is written whole: to a local temporary file, then one
object upload (`put`), which a reader sees complete or not at all (a
folder rename, a disk's commit, is a copy and a delete on a bucket).
Orbax writes its own checkpoints on `gs://` (tensorstore), committing a
step by its `commit_success.txt`; it has no S3 store.
"""

import contextlib
import importlib.util
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

from etils.epath import backend as _backends

__all__ = [
    "SERVED_BY",
    "basename",
    "check",
    "copy",
    "dirname",
    "download",
    "exists",
    "is_remote",
    "isdir",
    "join",
    "listdir",
    "mtime",
    "open_file",
    "read_text",
    "remove",
    "rmtree",
    "scheme",
    "served",
    "signature",
    "write_whole",
]

# The schemes keras_dist writes, and the package (and extra) serving each.
SERVED_BY = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


def scheme(path: "str | os.PathLike") -> str | None:
    """`"gs"` for `"gs://bucket/x"`; None for a local path."""
    text = os.fspath(path)
    if "://" not in text:
        return None
    return text.split("://", 1)[0].lower()


def is_remote(path: "str | os.PathLike") -> bool:
    return scheme(path) is not None


def check(path: "str | os.PathLike", *, argument: str, orbax: bool = False) -> str:
    """`path` as keras_dist keeps it: a local path made absolute, or a URL
    an installed library serves, as given. `orbax`: Orbax writes there
    (backups, sharded checkpoints), which it cannot on `s3://`.

    Raises:
        ValueError: a URL of a scheme keras_dist does not write, or whose
            package is not installed (naming the scheme and the package), or
            (`orbax`) an `s3://` URL.
    """
    text = os.fspath(path)
    kind = scheme(text)
    if kind is None:
        return os.path.abspath(text)
    if kind not in SERVED_BY:
        served = " or ".join(f"`{s}://`" for s in SERVED_BY)
        raise ValueError(
            f"`{argument}` names `{kind}://` storage, which keras_dist does not "
            f"write (and it never writes a URL as a local folder). Received: "
            f"{argument}={text!r}. Use a local path (an NFS mount included), "
            f"{served}."
        )
    if orbax and kind == "s3":
        raise ValueError(
            f"`{argument}` is an `s3://` URL, where Orbax, which writes backups "
            "and sharded checkpoints, has no store (it would write a local "
            f"folder named `s3:`). Received: {argument}={text!r}. Use `gs://` "
            "or a folder every host mounts (NFS), or write Keras files to S3: "
            "`ModelCheckpoint('s3://bucket/ckpt_{epoch}.weights.h5')`, "
            "`model.save_weights('s3://...')`."
        )
    package, extra = SERVED_BY[kind]
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"`{argument}` names `{kind}://` storage, served by the `{package}` "
            f"package, which is not installed. Received: {argument}={text!r}. "
            f"Install it: `pip install {package}` (keras_dist's `{extra}` extra: "
            f'`pip install -e ".[{extra}]"` in a checkout).'
        )
    return text


def served(path: "str | os.PathLike", *, argument: str) -> str:
    """`path` as a string, as given (`check`'s errors for a URL)."""
    text = os.fspath(path)
    return check(text, argument=argument) if is_remote(text) else text


def _backend(path: str):
    return _backends.fsspec_backend if is_remote(path) else _backends.os_backend


def _fresh(path: str) -> str:
    """`path`, with fsspec's cached listings of it dropped (another process
    or host writes there)."""
    if is_remote(path):
        _backends.fsspec_backend.fs(path).invalidate_cache()
    return path


def join(path: str, *names: str) -> str:
    return (posixpath if is_remote(path) else os.path).join(path, *names)


def dirname(path: str) -> str:
    return (posixpath if is_remote(path) else os.path).dirname(path)


def basename(path: str) -> str:
    return (posixpath if is_remote(path) else os.path).basename(path)


def exists(path: str) -> bool:
    return _backend(path).exists(_fresh(path))


def isdir(path: str) -> bool:
    return _backend(path).isdir(_fresh(path))


def listdir(path: str) -> list[str]:
    """The names in folder `path`; empty if there is no such folder."""
    try:
        return sorted(_backend(path).listdir(_fresh(path)))
    except (FileNotFoundError, NotADirectoryError):
        return []


def mtime(path: str) -> float:
    """`path`'s last modification (a bucket: its object's upload time)."""
    if not is_remote(path):
        return os.path.getmtime(path)
    return float(_backends.fsspec_backend.stat(path).mtime)


def signature(path: str) -> tuple:
    """What changes when file `path` is written again: its size and
    modification time (on a bucket also the object's generation or ETag).

    Raises:
        FileNotFoundError: `path` is gone.
    """
    if not is_remote(path):
        stat = os.stat(path)
        return (stat.st_size, stat.st_mtime_ns)
    fs = _backends.fsspec_backend.fs(path)
    fs.invalidate_cache()
    info = fs.info(path)
    if info.get("type") == "directory":
        raise FileNotFoundError(path)
    version = info.get("generation") or info.get("ETag") or info.get("etag")
    return (info.get("size"), str(info.get("mtime") or info.get("updated")), version)


def remove(path: str) -> None:
    """Deletes file `path`; nothing if it is gone."""
    with contextlib.suppress(FileNotFoundError):
        _backend(path).remove(path)


def rmtree(path: str) -> None:
    """Deletes folder `path` and everything in it; nothing if it is gone."""
    if is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            _backends.fsspec_backend.rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def copy(source: str, destination: str) -> None:
    """Copies file `source` to `destination` (replacing it): on one bucket,
    the store's own copy; else downloaded whole and uploaded whole."""
    if not is_remote(destination):
        with download(source) as local:
            shutil.copyfile(local, destination)
    elif scheme(source) == scheme(destination):
        _backends.fsspec_backend.fs(destination).copy(source, destination)
    else:
        with download(source) as local:
            _put(local, destination)


def open_file(path: str, mode: str = "r") -> IO:
    """File `path` opened in `mode` (on a bucket, a file written is
    uploaded whole when closed)."""
    return _backend(path).open(_fresh(path) if "r" in mode else path, mode)


def read_text(path: str) -> str:
    with _backend(path).open(_fresh(path), "r") as f:
        return f.read()


def _put(local: str, path: str) -> None:
    """Uploads local file `local` as object `path`, whole (one object: a
    reader sees the previous one or this one)."""
    with open(local, "rb") as source, _backends.fsspec_backend.open(path, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 22)


@contextlib.contextmanager
def download(path: str) -> Iterator[str]:
    """A local copy of `path` (a file or a folder) while the context lasts;
    `path` itself if it is local."""
    if not is_remote(path):
        yield path
        return
    scratch = tempfile.mkdtemp(prefix="keras_dist-download-")
    try:
        local = os.path.join(scratch, posixpath.basename(path.rstrip("/")))
        fs = _backends.fsspec_backend.fs(path)
        fs.invalidate_cache()
        fs.get(path, local, recursive=fs.isdir(path))
        yield local
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_whole(path: str, write: Callable[[str], object], name: str) -> None:
    """On a bucket: `write(local)` into a temporary file named `name` (the
    format's checks read the suffix), then one upload to `path`."""
    scratch = tempfile.mkdtemp(prefix="keras_dist-upload-")
    try:
        local = os.path.join(scratch, name)
        write(local)
        _put(local, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
