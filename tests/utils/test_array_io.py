"""The checkpoint writers' vectored writes and array parts (`utils/_array_io.py`)."""

import errno
import mmap
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.utils import _array_io
from keras_dist.utils._array_io import (
    FileLayout,
    distinct_parts,
    run_start,
    write_buffers,
    write_file,
)


def _direct_io_works(directory) -> bool:
    """Whether the file system of `directory` takes a direct write."""
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


def _odd_buffers(seed: int, count: int) -> list:
    rng = np.random.default_rng(seed)
    buffers = [
        rng.integers(0, 255, int(n), dtype=np.uint8)
        for n in rng.integers(0, 9000, count)
    ]
    buffers.append(np.arange(40.0).reshape(5, 8)[:, ::3])  # Not contiguous.
    buffers.append(np.zeros(0, np.float32))
    return buffers


@pytest.mark.parametrize("staging", [4096, 3 * 4096])
def test_write_file_direct_through_a_bounded_staging_buffer(
    tmp_path, monkeypatch, staging
):
    """Buffers of every size crossing the staging buffer's edges, a total
    that is no multiple of the block: the file holds exactly their bytes
    (no padding left), written direct where the file system takes it;
    an existing longer file is replaced whole."""
    monkeypatch.setattr(_array_io, "DIRECT_MIN_BYTES", 1)
    monkeypatch.setattr(_array_io, "_STAGING_BYTES", staging)
    buffers = _odd_buffers(1, 30)
    expected = b"".join(np.ascontiguousarray(b).tobytes() for b in buffers)
    assert len(expected) % 4096 and len(expected) > 4 * staging
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (len(expected) + 10_000))
    assert write_file(str(path), buffers) is _direct_io_works(tmp_path)
    assert path.read_bytes() == expected
    # A file of exactly whole staging buffers, and an empty one.
    whole = np.arange(2 * staging, dtype=np.uint8)
    write_file(str(path), [whole[:100], whole[100:]], sync=False)
    assert path.read_bytes() == whole.tobytes()
    assert write_file(str(path), []) is False  # Under the minimum: buffered.
    assert path.read_bytes() == b""


@pytest.mark.parametrize("refused_at", ["open", "first write", "no O_DIRECT"])
def test_write_file_buffered_where_direct_io_is_refused(
    tmp_path, monkeypatch, refused_at
):
    """File systems without direct I/O refuse it at `open` (older tmpfs) or
    at the first write (some FUSE and network file systems), with EINVAL;
    some systems have no `O_DIRECT` (macOS, Windows). Faked here (this
    box's file systems take it): the file is written buffered, whole."""
    monkeypatch.setattr(_array_io, "DIRECT_MIN_BYTES", 1)
    monkeypatch.setattr(_array_io, "_STAGING_BYTES", 4096)
    real_open, real_pwrite = os.open, os.pwrite
    direct = getattr(os, "O_DIRECT", 0)
    if refused_at == "no O_DIRECT":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    elif refused_at == "open":

        def refusing_open(path, flags, *args):
            if flags & direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", refusing_open)
    else:
        import fcntl

        def refusing_pwrite(fd, data, offset):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    buffers = _odd_buffers(2, 12)
    expected = b"".join(np.ascontiguousarray(b).tobytes() for b in buffers)
    path = tmp_path / "f.bin"
    assert write_file(str(path), buffers) is False
    assert path.read_bytes() == expected


def test_write_file_raises_a_write_error_after_the_first_block(tmp_path, monkeypatch):
    """Only a refusal of the first write means "no direct I/O here": a
    failure later (a disk full mid-file) raises, not rewritten buffered."""
    monkeypatch.setattr(_array_io, "DIRECT_MIN_BYTES", 1)
    monkeypatch.setattr(_array_io, "_STAGING_BYTES", 4096)
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system takes no direct writes")
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):
        if offset >= 8192:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_file(str(tmp_path / "f.bin"), _odd_buffers(3, 12))


@pytest.mark.parametrize("vectored", [True, False])
def test_write_buffers_writes_every_byte_in_order(tmp_path, monkeypatch, vectored):
    """More buffers than one vectored call takes (1024), of every size, some
    empty, not all contiguous: the file holds them all, in order, at the
    file's position or at an offset; one buffer a call where the platform
    has no vectored writes (Windows)."""
    if not vectored:
        monkeypatch.delattr(os, "pwritev")
        monkeypatch.delattr(os, "writev")
    rng = np.random.default_rng(0)
    buffers = [
        rng.integers(0, 255, int(n), dtype=np.uint8) for n in rng.integers(0, 40, 2500)
    ]
    buffers.append(np.arange(12.0).reshape(3, 4)[:, ::2])  # Not contiguous.
    expected = b"".join(np.ascontiguousarray(b).tobytes() for b in buffers)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"head")
        assert write_buffers(fd, buffers) == len(expected)
        assert write_buffers(fd, [np.frombuffer(b"XY", np.uint8)], offset=1) == 2
    finally:
        os.close(fd)
    assert path.read_bytes() == b"hXYd" + expected


@pytest.mark.parametrize(
    ("bounds", "shape", "start"),
    [
        (((0, 2), (0, 6)), (8, 6), 0),
        (((4, 6), (0, 6)), (8, 6), 24),
        (((1, 2), (2, 5)), (8, 6), 8),  # One row: a run.
        (((0, 2), (2, 5)), (8, 6), None),  # Two rows, part of each.
        (((0, 8), (0, 3)), (8, 6), None),
        (((2, 3), (0, 1), (0, 6)), (4, 1, 6), 12),
        (((0, 8), (0, 6)), (8, 6), 0),
        ((), (), 0),
    ],
)
def test_run_start(bounds, shape, start):
    assert run_start(bounds, shape) == start


def test_distinct_parts_once_each_and_on_the_host():
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices())
    value = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    split = jax.device_put(value, NamedSharding(mesh, PartitionSpec("a")))
    replicated = jax.device_put(value, NamedSharding(mesh, PartitionSpec()))
    host = np.ones((2, 3))
    split_parts, replicated_parts, host_parts = distinct_parts(
        [split, replicated, host]
    )
    assert [b for b, _ in split_parts] == [
        ((2 * i, 2 * i + 2), (0, 6)) for i in range(4)
    ]
    for bounds, data in split_parts:
        assert isinstance(data, np.ndarray) and data.flags.c_contiguous
        np.testing.assert_array_equal(data, value[slice(*bounds[0])])
    assert [b for b, _ in replicated_parts] == [((0, 8), (0, 6))]
    np.testing.assert_array_equal(replicated_parts[0][1], value)
    assert host_parts == [(((0, 2), (0, 3)), host)]


def test_a_file_layout_keeps_the_file_own_bytes_and_refuses_overlaps(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"HEAD" + bytes(8) + b"MID" + bytes(4) + b"TAIL")
    layout = FileLayout.read(str(path), [(15, 4), (4, 8)])  # Not in file order.
    assert layout.pieces == (b"HEAD", 1, b"MID", 0, b"TAIL")
    first = np.array([1, 2, 3, 4], np.uint8)
    second = np.arange(2, dtype=np.float32)  # 8 bytes.
    out = tmp_path / "g.bin"
    layout.write(str(out), [first, second], distinct_parts([first, second]))
    assert out.read_bytes() == b"HEAD" + second.tobytes() + b"MID" + b"\1\2\3\4TAIL"
    with pytest.raises(ValueError, match="array 0's bytes at 6 overlap"):
        FileLayout.read(str(path), [(6, 4), (4, 8)])
