"""Input over several processes: one global batch, each process its rows.

Two ways a batch reaches a mesh that spans processes:

- **Global batches** (NumPy and every other in-memory input, PyDataset,
  generators, Grain, and tf.data under `AutoShardPolicy.AUTO/DATA`): every
  process reads the same global batch, pads it to a multiple of the replicas
  (padding at the end) and hands JAX only the rows of its own devices. The
  result is row for row the single-process batch, so training is exactly the
  single-process training. Each pass checks, once, that all processes read
  the same data (size and checksum of the first batch, number of batches).
- **Per-process blocks** (`distribute_datasets_from_function`, tf.data under
  `AutoShardPolicy.FILE/OFF`): each process brings its own rows. Before every
  step the processes exchange their row counts (through the coordination
  service, with a timeout), pad to a common block size, and a process whose
  input ended contributes an all-padding block; the pass ends when every
  process is done. So every process runs the same number of steps and none
  waits forever in a collective.
"""

import math
import zlib
from typing import Any

import jax
import numpy as np

from keras_dist.cluster import _sync
from keras_dist.data._partial_batch import batch_size_of, pad_to, round_up
from keras_dist.data._sparse import is_leaf, is_sparse, map_rows, pad_sparse
from keras_dist.errors import ProcessMismatchError

__all__ = ["ProcessBlocks", "check_pass_end", "check_pass_start", "global_rows"]


def _is_array(leaf) -> bool:
    return leaf is not None and getattr(leaf, "ndim", 0) > 0


def global_rows(data: Any, multiple: int, rows: slice) -> tuple[Any, int, int | None]:
    """This process's `rows` of the global batch `data`, padded with zeros.

    Returns `(local, padded_size, num_real)`: the local rows, the global size
    after padding to a multiple of `multiple`, and the real size if padded.
    """
    size = batch_size_of(data)
    if size is None:
        return data, 0, None
    padded = round_up(size, multiple)
    want = rows.stop - rows.start

    def take(leaf):
        if not _is_array(leaf):
            return leaf
        return pad_to(leaf[rows.start : min(rows.stop, size)], want)

    # A sparse matrix is laid out replicated: every process keeps it whole.
    local = map_rows(take, lambda leaf: pad_sparse(leaf, padded), data)
    return local, padded, (size if padded != size else None)


def _checksum(data: Any) -> int:
    crc = 0
    for leaf in jax.tree.leaves(data):
        if _is_array(leaf):
            crc = zlib.crc32(
                # numpy declares `ndarray.__buffer__` for Python >= 3.12 only.
                np.ascontiguousarray(leaf).view(np.uint8),  # type: ignore[arg-type]
                crc,
            )
    return crc


def check_pass_start(data: Any, source: str, channel: str) -> None:
    """All processes read the same first global batch (size and checksum).

    Raises:
        ProcessMismatchError: naming each process's batch size and checksum when they
            differ, with the fix (same data, same seed, on every process).
    """
    mine = {"rows": batch_size_of(data), "checksum": _checksum(data)}
    everyone = _sync.allgather(channel, mine)
    if all(other == everyone[0] for other in everyone):
        return
    found = ", ".join(
        f"process {p}: {v['rows']} rows (checksum {v['checksum']:08x})"
        for p, v in enumerate(everyone)
    )
    raise ProcessMismatchError(
        f"The processes read different global batches from {source} ({found}). "
        "With several processes every process must pass the same full dataset "
        "and the same global `batch_size` (keras_dist splits each global batch "
        "over the processes): shuffle with a fixed seed (e.g. "
        "`dataset.shuffle(n, seed=1)` or `keras.utils.set_random_seed(1)` on "
        "every process). To give each process its own data instead, use "
        "`strategy.distribute_datasets_from_function` or a tf.data dataset with "
        "`kd.data.AutoShardPolicy.FILE` or `OFF`."
    )


def check_pass_end(batches: int, source: str, channel: str) -> None:
    """All processes read the same number of global batches this pass."""
    everyone = _sync.allgather(channel, batches)
    if len(set(everyone)) > 1:
        found = ", ".join(f"process {p}: {n}" for p, n in enumerate(everyone))
        raise ProcessMismatchError(
            f"The processes read different numbers of global batches from "
            f"{source} in one pass ({found}). Every process must pass the same "
            "full dataset; see `kd.data.AutoShardPolicy` to split data yourself."
        )


class ProcessBlocks:
    """Builds each step's per-process block after agreeing on the row counts.

    Args:
        local_replicas: replicas (devices) of this process; a block's size
            is a multiple of it.
        source: names the input in errors.
        channel: the exchange name (from `_sync.channel`), made on the main
            thread.
    """

    def __init__(self, local_replicas: int, source: str, channel: str):
        self._local = local_replicas
        self._source = source
        self._channel = channel
        self._template = None

    def __call__(self, batch: Any | None):
        """`batch` is this process's rows for the step, or None if its input ended.

        Returns `(block, block_rows, segments)` — this process's padded rows,
        the common block size, and the real `(start, count)` row segments of
        the global batch (`None` when nothing is padded) — or None when every
        process's input has ended.

        Raises:
            ValueError: if a process's input produced no batch at all while
                others still have data (there is nothing to pad it like).
        """
        if batch is not None and any(
            is_sparse(leaf) for leaf in jax.tree.leaves(batch, is_leaf=is_leaf)
        ):
            raise ValueError(
                f"{self._source} gives each process its own sparse rows "
                "(AutoShardPolicy.FILE/OFF or distribute_datasets_from_function), "
                "but a sparse batch is laid out replicated and must be the same "
                "global batch on every process. Received: a sparse element. Use "
                "AutoShardPolicy.DATA (every process reads the global batch), or "
                "densify the batch in the dataset (`tf.sparse.to_dense`)."
            )
        rows = 0 if batch is None else batch_size_of(batch)
        counts = _sync.allgather(self._channel, rows)
        if not any(counts):
            return None
        block = max(math.ceil(c / self._local) * self._local for c in counts)
        if batch is None:
            if self._template is None:
                raise ProcessMismatchError(
                    f"This process's input ({self._source}) produced no batch, "
                    f"while other processes have data (rows per process: {counts}). "
                    "Give every process at least one batch (e.g. shard files "
                    "so each process gets one, or use AutoShardPolicy.DATA)."
                )
            batch = jax.tree.map(lambda t: t[:0], self._template)
        else:
            self._template = batch
        padded = jax.tree.map(lambda leaf: pad_to(leaf, block), batch)
        segments = tuple(
            (index * block, count) for index, count in enumerate(counts) if count
        )
        unpadded = all(c == block for c in counts)
        return padded, block, None if unpadded else segments
