"""The checkpoint writers' vectored writes and array parts (`utils/_array_io.py`)."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.utils._array_io import (
    FileLayout,
    distinct_parts,
    run_start,
    write_buffers,
)


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
