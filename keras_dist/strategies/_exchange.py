"""A shuffled pass's batches, laid out from rows split over the replicas.

A device-resident dataset that `fit` shuffles is split over the replicas by
rows (`ResidentPlacement.place_rows`): replica `r` holds rows
`r * n ... (r + 1) * n - 1`, 1/replicas of it. At the start of each pass
(an epoch), its batches in the pass's order are laid out once as blocks
`(steps, batch, ...)` split over the replicas along the batch axis, as a
dataset read in order is (`ResidentPlacement.place_blocks`): each step then
takes its block (`take_block`), with no gather and no communication.

The reordering is one program a pass (`exchange`): each replica takes from
its rows the ones every other replica needs, in `C`-row chunks, one chunk a
destination (`send`); one `all_to_all` delivers them; each replica puts the
rows it received in its order (`receive`). Each row moves once. The plan
(which row goes where) is made on the host from the pass's index batches
(`plan_exchange`): a few milliseconds a pass, and two int32 tables of about
one entry a row to transfer.

`C` is the most rows one replica sends another, rounded up to a ladder
(`_chunk_rows`) so that the passes of a `fit` share one compiled program.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

__all__ = ["ExchangePlan", "exchange", "plan_exchange"]

_AXIS = "batch"


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Where each row of a pass comes from, per replica.

    Attributes:
        send: int32 `(replicas, replicas, C)`: `send[s, d]` are the rows of
            replica `s` (local indices) that replica `d` needs, padded.
        receive: int32 `(replicas, m)`: replica `d`'s `m` rows of the pass,
            each an index into the `replicas * C` rows it receives (`s * C +
            c`), or -1 (a padding row: zeros).
        segments: static `(batches, rows)` of each output: the rows a
            replica holds of each of `batches` batches, in order.
    """

    send: np.ndarray
    receive: np.ndarray
    segments: tuple[tuple[int, int], ...]


def plan_exchange(
    batches: Sequence[np.ndarray], replica_rows: int, replicas: int
) -> ExchangePlan:
    """Plans the layout of `batches` from rows split `replica_rows` a replica.

    Args:
        batches: groups of batches, each an int32 array `(count, rows)`
            (rows: a multiple of `replicas`; -1: padding), one output each.
        replica_rows: the dataset rows each replica holds.
        replicas: the replica count.
    """
    shares, segments = [], []
    for group in batches:
        count, rows = group.shape
        width = rows // replicas
        # Replica d's rows of each batch of the group: its columns.
        shares.append(group.reshape(count, replicas, width).transpose(1, 0, 2))
        segments.append((count, width))
    wanted = np.concatenate([s.reshape(replicas, -1) for s in shares], axis=1)
    m = wanted.shape[1]
    real = wanted >= 0
    source = np.where(real, wanted // replica_rows, replicas)  # Padding last.
    local = np.where(real, wanted % replica_rows, 0)
    dest = np.broadcast_to(np.arange(replicas)[:, None], wanted.shape)
    key = (dest * (replicas + 1) + source).ravel()
    counts = np.bincount(key, minlength=replicas * (replicas + 1))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.argsort(key, kind="stable")
    rank = np.empty(key.size, np.int64)
    rank[order] = np.arange(key.size) - starts[key[order]]
    rank = rank.reshape(wanted.shape)
    real_counts = counts.reshape(replicas, replicas + 1)[:, :replicas]
    chunk = _chunk_rows(int(real_counts.max(initial=0)), m, replicas)
    send = np.zeros((replicas, replicas, chunk), np.int32)
    send[source[real], dest[real], rank[real]] = local[real]
    receive = np.where(real, source * chunk + rank, -1).astype(np.int32)
    return ExchangePlan(send, receive, tuple(segments))


def _chunk_rows(most: int, m: int, replicas: int) -> int:
    """The rows of one replica-to-replica chunk: at least `most`, from a ladder.

    A replica's `m` rows come about `m / replicas` from each replica; the
    first rung leaves room for four standard deviations more, so a shuffled
    pass almost always lands on it, and every pass of a `fit` compiles once.
    """
    even = -(-m // replicas)
    rung = even + max(-(-even // 8), int(np.ceil(4 * np.sqrt(even))), 1)
    while rung < most:
        rung *= 2
    return max(1, min(rung, m))


def exchange(
    mesh: Mesh,
    rows: Sequence[jax.Array],
    send: jax.Array,
    receive: jax.Array,
    segments: tuple[tuple[int, int], ...],
) -> list[list[jax.Array]]:
    """The pass's batches as blocks, from `rows` split over `mesh`.

    Args:
        mesh: the 1-D mesh (axis `"batch"`).
        rows: the dataset's arrays, split over `mesh` by rows.
        send, receive: `ExchangePlan.send`/`receive`, split over `mesh`
            along their first axis.
        segments: `ExchangePlan.segments`.

    Returns:
        Per segment, per array of `rows`: `(batches, batch_rows, ...)` split
        along the second axis, as `ResidentPlacement.place_blocks` lays out.
    """
    return _exchanger(mesh, segments)(list(rows), send, receive)


@functools.cache
def _exchanger(mesh: Mesh, segments: tuple[tuple[int, int], ...]) -> Callable:
    def local(rows: list, send, receive) -> list:
        send, receive = send[0], receive[0]
        real = receive >= 0
        out = []
        for array in rows:
            sent = jnp.take(array, send.reshape(-1), axis=0)
            got = jax.lax.all_to_all(sent, _AXIS, 0, 0, tiled=True)
            mine = jnp.take(got, jnp.maximum(receive, 0), axis=0)
            mask = real.reshape((-1,) + (1,) * (array.ndim - 1))
            mine = jnp.where(mask, mine, jnp.zeros((), mine.dtype))
            out.append(_split(mine, segments))
        return [[parts[i] for parts in out] for i in range(len(segments))]

    spec = PartitionSpec(_AXIS)
    blocks = PartitionSpec(None, _AXIS)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=[blocks] * len(segments),
    )
    return jax.jit(mapped)


def _split(mine, segments) -> list:
    parts, offset = [], 0
    for count, width in segments:
        part = mine[offset : offset + count * width]
        parts.append(part.reshape(count, width, *mine.shape[1:]))
        offset += count * width
    return parts
