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

A checkpoint's data file goes to disk with direct I/O (`O_DIRECT`) where
the system has it (`write_file`): through a bounded staging buffer, past the
page cache. A buffered write of a new gigabyte, then `fsync`, cost this
repository's VM 0.3-3.1 s of kernel CPU (page-cache reclaim and writeback);
the same file written direct cost 0.3-0.5 s of the box's CPU in all, the
staging copy included (`benchmarks/save_cost.py`, its "direct I/O" rows).
CPU a background save takes is CPU a host-bound training loop loses.
"""

import errno
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
    "write_file",
]

# [start, stop) per axis, and the part's values on the host (C order).
Part = tuple[tuple[tuple[int, int], ...], np.ndarray]

_IOV_MAX = 1024  # Linux's limit on the buffers of one vectored call.
# Direct I/O: offsets, lengths and buffer addresses in multiples of this
# (every device's logical block divides it); files from this size up; the
# staging buffer's size (the memory a write takes beside the state).
_DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 16 << 20
_STAGING_BYTES = 16 << 20


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


def write_file(
    path: str, buffers: Sequence, *, sync: bool = True, direct: bool | None = None
) -> bool:
    """Makes (or truncates) the file `path` holding `buffers` one after
    another; with `sync`, on disk before it returns (`fsync`).

    With `direct` (by default: from `DIRECT_MIN_BYTES` up), where the
    system has direct I/O, the bytes
    pass through a staging buffer of `_STAGING_BYTES` to the disk, past the
    page cache; where the file system refuses direct I/O (tmpfs before
    Linux 6.6, some network file systems), the file is written buffered instead.

    Returns:
        Whether the file was written with direct I/O.
    """
    total = sum(int(np.asarray(b).nbytes) for b in buffers)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    o_direct: int = getattr(os, "O_DIRECT", 0)  # (Linux's.)
    if direct is None:
        direct = total >= DIRECT_MIN_BYTES
    if direct and o_direct:
        try:
            fd = os.open(path, flags | o_direct, 0o644)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
        else:
            try:
                written = _write_direct(fd, buffers, total)
                if written and sync:
                    os.fsync(fd)  # The size, and the disk's own cache.
            finally:
                os.close(fd)
            if written:
                return True
    fd = os.open(path, flags, 0o644)
    try:
        write_buffers(fd, buffers)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return False


def _write_direct(fd: int, buffers: Sequence, total: int) -> bool:
    """Writes `buffers` (`total` bytes) to the new file `fd`, opened with
    `O_DIRECT`, in whole staging buffers; the last one padded to the block,
    then the file cut to `total`. False if the file system refused the
    first write (then nothing was written)."""
    stage = _aligned_empty(_STAGING_BYTES)
    filled = offset = 0
    for buffer in buffers:
        flat = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
        start = 0
        while start < flat.size:
            n = min(_STAGING_BYTES - filled, flat.size - start)
            stage[filled : filled + n] = flat[start : start + n]
            filled, start = filled + n, start + n
            if filled == _STAGING_BYTES:
                if not _write_block(fd, stage[:filled], offset):
                    return False
                offset, filled = offset + filled, 0
    if filled:
        padded = -(-filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
        stage[filled:padded] = 0
        if not _write_block(fd, stage[:padded], offset):
            return False
    os.ftruncate(fd, total)
    return True


def _aligned_empty(nbytes: int) -> np.ndarray:
    """`nbytes` of uninitialised memory starting on a `_DIRECT_ALIGN` boundary."""
    raw = np.empty(nbytes + _DIRECT_ALIGN, np.uint8)
    skip = -raw.ctypes.data % _DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def _write_block(fd: int, block: np.ndarray, offset: int) -> bool:
    """`block` (aligned, whole blocks) at `offset`; False where the file
    system refuses direct I/O on the file's first write."""
    done = 0
    while done < block.nbytes:  # Direct writes may stop short at a full disk.
        try:
            written = os.pwrite(fd, block[done:].data, offset + done)
        except OSError as error:
            if error.errno == errno.EINVAL and offset + done == 0:
                return False
            raise
        if not written:
            raise OSError(errno.EIO, f"Wrote 0 of {block.nbytes - done} bytes.")
        done += written
    return True


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

    def write(
        self, path: str, arrays: Sequence, parts: list[list[Part]], *, sync=False
    ) -> None:
        """Writes the file `path`: its own bytes and `arrays`' (whose
        `distinct_parts` are `parts`), `write_file`'s way."""
        buffers: list = []
        for piece in self.pieces:
            if isinstance(piece, bytes):
                buffers.append(np.frombuffer(piece, np.uint8))
            else:
                buffers += in_c_order(arrays[piece], parts[piece])
        write_file(path, buffers, sync=sync)


def _read(fd: int, offset: int, nbytes: int) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise OSError(f"Read {len(data)} of {nbytes} bytes at offset {offset}.")
    return data
