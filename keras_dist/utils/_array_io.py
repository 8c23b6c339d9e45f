"""Arrays' parts written to files in few system calls.

A checkpoint writer runs on a background thread beside a training thread
that dispatches steps in Python. Each time the writer gives up Python's lock
(the GIL) for a system call and takes it back, the training thread hands the
lock over and waits: ~0.1-0.25 ms a call on this repository's 2-core box,
with a write of a few hundred calls costing the training thread 30-130 ms
(`benchmarks/save_cost.py`, its "training thread stalled" column). So the
writers gather every part first (every device -> host copy started at once),
then write them with vectored calls (`os.writev` / `os.pwritev`, up to 1024
buffers each), which hold no lock while the kernel copies the bytes.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

__all__ = [
    "FileLayout",
    "Part",
    "distinct_parts",
    "in_c_order",
    "index_bounds",
    "run_start",
    "write_buffers",
]

# [start, stop) per axis, and the part's values on the host (C order).
Part = tuple[tuple[tuple[int, int], ...], np.ndarray]

_IOV_MAX = 1024  # Linux's limit on the buffers of one vectored call.


def index_bounds(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as [start, stop) per axis."""
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def distinct_parts(arrays: Sequence) -> list[list[Part]]:
    """Each array's distinct parts on this process, on the host.

    A part several devices hold (a replicated array's, or a part on several
    devices of a mesh axis) comes once. A NumPy array is one part. Every
    device -> host copy starts before the first is waited for.
    """
    pending: list[list] = []
    for a in arrays:
        if not isinstance(a, jax.Array):
            whole = tuple((0, n) for n in np.shape(a))
            pending.append([(whole, a)])
            continue
        parts, seen = [], set()
        for shard in a.addressable_shards:
            bounds = index_bounds(shard.index, tuple(a.shape))
            if bounds in seen:
                continue
            seen.add(bounds)
            if shard.device.platform != "cpu":  # (On CPU, no copy is made.)
                shard.data.copy_to_host_async()
            parts.append((bounds, shard.data))
        pending.append(parts)
    return [
        [(bounds, np.ascontiguousarray(data)) for bounds, data in parts]
        for parts in pending
    ]


def run_start(bounds: tuple, shape: tuple) -> int | None:
    """The C-order index where the block `bounds` ([start, stop) per axis)
    of an array of `shape` starts, if its elements are one run; else None."""
    split = [i for i, (a, b) in enumerate(bounds) if (a, b) != (0, shape[i])]
    # Whole after the last split axis, one index on each axis before it.
    if split and any(b - a != 1 for a, b in bounds[: split[-1]]):
        return None
    return int(np.ravel_multi_index([a for a, _ in bounds], shape)) if shape else 0


def in_c_order(value, parts: list[Part]) -> list[np.ndarray]:
    """Buffers holding `value`'s bytes in C order: its `parts`, when each is
    one run of them; else the whole array assembled from the parts."""
    shape = tuple(value.shape)
    runs = [(run_start(bounds, shape), data) for bounds, data in parts]
    if all(start is not None for start, _ in runs):
        return [data for _, data in sorted(runs, key=lambda run: run[0] or 0)]
    whole = np.empty(shape, np.dtype(value.dtype))
    for bounds, data in parts:
        whole[tuple(slice(a, b) for a, b in bounds)] = data
    return [whole]


def write_buffers(fd: int, buffers: Sequence, offset: int | None = None) -> int:
    """Writes `buffers` one after another: at `offset` of the file `fd`, or
    at its position. Returns the bytes written (all of them)."""
    views = [
        memoryview(np.ascontiguousarray(b).reshape(-1).view(np.uint8).data)
        for b in buffers
    ]
    views = [v for v in views if v.nbytes]
    total, first = 0, 0
    while first < len(views):
        batch = views[first : first + _IOV_MAX]
        if not hasattr(os, "pwritev"):  # (Windows): one buffer a call.
            batch = batch[:1]
        if offset is None:
            written = os.writev(fd, batch) if len(batch) > 1 else os.write(fd, batch[0])
        elif len(batch) > 1:
            written = os.pwritev(fd, batch, offset + total)
        else:
            written = os.pwrite(fd, batch[0], offset + total)
        total += written
        while first < len(views) and written >= views[first].nbytes:
            written -= views[first].nbytes
            first += 1
        if written:  # A part written in part: the rest of it next.
            views[first] = views[first][written:]
    return total


@dataclass(frozen=True)
class FileLayout:
    """A file's own bytes around the arrays it holds: a format's metadata
    (HDF5's, say), kept to write the next file of the same structure with
    other arrays' values without the format's library.

    `pieces`, in file order: `bytes` of the file's own, or the index of an
    array whose C-order bytes go there.
    """

    pieces: tuple

    @classmethod
    def read(cls, path: str, regions: Sequence[tuple[int, int]]) -> "FileLayout":
        """The layout of the file `path`, where array `i` fills the bytes
        [offset, offset + nbytes) of `regions[i]`.

        Raises:
            ValueError: two regions overlap.
        """
        pieces: list = []
        position = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for i in sorted(range(len(regions)), key=lambda i: regions[i][0]):
                offset, nbytes = regions[i]
                if offset < position:
                    raise ValueError(
                        f"{path}: array {i}'s bytes at {offset} overlap the "
                        f"previous array's, which end at {position}."
                    )
                pieces += [_read(fd, position, offset - position), i]
                position = offset + nbytes
            pieces.append(_read(fd, position, max(size - position, 0)))
        finally:
            os.close(fd)
        return cls(tuple(p for p in pieces if not isinstance(p, bytes) or p))

    def write(self, path: str, arrays: Sequence, parts: list[list[Part]]) -> None:
        """Writes the file `path`: its own bytes and `arrays`' (whose
        `distinct_parts` are `parts`), in a few vectored calls."""
        buffers: list = []
        for piece in self.pieces:
            if isinstance(piece, bytes):
                buffers.append(np.frombuffer(piece, np.uint8))
            else:
                buffers += in_c_order(arrays[piece], parts[piece])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_buffers(fd, buffers)
        finally:
            os.close(fd)


def _read(fd: int, offset: int, nbytes: int) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise OSError(f"Read {len(data)} of {nbytes} bytes at offset {offset}.")
    return data
