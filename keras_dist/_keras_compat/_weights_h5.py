"""Seam 12 (its `.weights.h5` writer): Keras's weights file with few calls
into h5py or the kernel.

`write_weights_h5(entries, path)` writes the file `model.save_weights`
writes from a `Snapshot`'s entries (`_saving.py`), on `ModelCheckpoint`'s
writer thread. It makes datasets in `H5IOStore`'s current group itself,
through four private attributes of `H5IOStore` (in the seam tables,
`_private.py`).
"""

import threading

import jax
import numpy as np
from keras.src.saving.saving_lib import H5IOStore

from keras_dist.utils._array_io import FileLayout, distinct_parts

__all__ = ["write_weights_h5"]

# The files' layouts (HDF5's own bytes) by structure, for the next save of
# the same structure (a few models' at most).
_LAYOUTS: dict[tuple, FileLayout] = {}
_LAYOUTS_LOCK = threading.Lock()


def _region(value) -> bool:
    """Whether `value` is written as bytes at an offset of the file: a
    non-empty array of numbers (bfloat16 too); an empty one is metadata."""
    if not isinstance(value, (np.ndarray, np.generic, jax.Array)) or value.size == 0:
        return False
    return np.dtype(value.dtype).kind in "iuf" or _bfloat16(value)


def _bfloat16(value) -> bool:
    return np.dtype(value.dtype).name == "bfloat16"


def _structure(entries: list) -> tuple | None:
    """What a `.weights.h5` file's own bytes depend on (None: a value that
    h5py must write itself, e.g. a string)."""
    structure = []
    for path, metadata, values in entries:
        arrays = []
        for key, value in values.items():
            if not isinstance(value, (np.ndarray, np.generic, jax.Array)):
                return None
            if not _region(value) and np.dtype(value.dtype).kind not in "iuf":
                return None
            arrays.append((key, tuple(value.shape), str(value.dtype)))
        meta = tuple(sorted((k, repr(v)) for k, v in (metadata or {}).items()))
        structure.append((path, meta, tuple(arrays)))
    return tuple(structure)


def write_weights_h5(entries: list, path: str) -> None:
    """`entries` (a `Snapshot`'s: `[(path, metadata, {key: value})]`, in
    Keras's order) as the `.weights.h5` file `save_weights` writes, with few
    calls into h5py or the kernel.

    A background writer shares Python's lock (the GIL) with a training
    thread that dispatches steps in Python (every host-bound loop): h5py
    holds it while it writes a dataset's bytes, and each call that gives it
    up and takes it back makes the training thread hand it over and wait.
    Here h5py (through Keras's `H5IOStore`) only makes the file's
    structure, each array's storage allocated in place; the file's own
    bytes around the arrays are kept (`FileLayout`), and later saves of the
    same structure skip h5py. Then the whole file, its own bytes and every
    array's parts, goes out in a few vectored writes (a split array's parts
    to their places, not assembled first unless they are not runs of its
    bytes). The file is Keras's format.
    """
    structure = _structure(entries)
    with _LAYOUTS_LOCK:
        layout = _LAYOUTS.get(structure) if structure is not None else None
    arrays = [v for _, _, group in entries for v in group.values() if _region(v)]
    if layout is None:
        regions = _make_h5_structure(entries, path)
        layout = FileLayout.read(path, regions)
        if structure is not None:
            with _LAYOUTS_LOCK:
                if len(_LAYOUTS) >= 4:
                    _LAYOUTS.pop(next(iter(_LAYOUTS)))
                _LAYOUTS[structure] = layout
    layout.write(path, arrays, distinct_parts(arrays))


def _make_h5_structure(entries: list, path: str) -> list[tuple[int, int]]:
    """Makes the file `path` as `H5IOStore` would, each region value's
    storage allocated but (mostly) unwritten; returns those values' [offset,
    nbytes] in the file, in `entries`' order."""
    store = H5IOStore(path, mode="w")
    regions = []
    try:
        for entry_path, metadata, values in entries:
            entry = store.make(entry_path, metadata=metadata)
            for key, value in values.items():
                if not _region(value):
                    entry[key] = value
                    continue
                if not store._h5_entry_initialized:  # As `entry[key] = ...` does.
                    store._create_h5_group(store._h5_entry_path)
                dataset = store._h5_entry_group.create_dataset(
                    key, shape=value.shape, dtype=np.dtype(value.dtype), dcpl=_dcpl()
                )
                if _bfloat16(value):  # As `entry[key] = ...` marks it.
                    dataset.attrs["dtype"] = "bfloat16"
                if dataset.id.get_offset() is None:  # A scalar: allocated late.
                    dataset[...] = np.asarray(value)
                regions.append((dataset.id.get_offset(), int(value.nbytes)))
    finally:
        store.close()
    return regions


def _dcpl():
    """A dataset's creation properties: contiguous storage allocated when
    it is created (its offset known), never filled (the bytes follow)."""
    import h5py  # type: ignore[import-untyped]

    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl
