"""A shuffled pass's batches, laid out from rows split over the replicas.

A device-resident dataset that `fit` shuffles and that no device can hold
whole is split over the replicas by rows (`ResidentPlacement.lay_out_rows`):
replica `r` holds rows `r * n ... (r + 1) * n - 1`, 1/replicas of it. At
the start of each pass (an epoch), its batches in the pass's order are
laid out once as blocks
`(steps, batch, ...)` split over the replicas along the batch axis, as a
dataset read in order is (`ResidentPlacement.lay_out_blocks`): each step then
takes its block (`take_block`), with no gather and no communication.

The reordering is one program a pass (`exchange`): each replica takes from
its rows the ones every other replica needs, in `C`-row chunks, one chunk a
destination (`send`); an `all_to_all` delivers them; each replica puts the
rows it received in its order (`receive`). Each row moves once. A large
pass goes in rounds, each laying out a part of each replica's rows, so that
what is in flight stays bounded (`round_rows`). The plan (which row goes
where) is made on the host from the pass's index batches (`plan_exchange`),
and two int32 tables of about one entry a row are transferred.

On CPU devices the exchange costs more than the copy's gathers it replaces
(all devices share the host's cores and memory, so an `all_to_all` of the
rows is a copy through the same RAM plus a collective), and the host path
beats it too: `python benchmarks/single_vs_mirrored.py --models tiny
--configs B,BS,BR` measures it (BR against BS; BS with `--input host` for
the host path). So data a device can hold is copied,
data it cannot goes through the host, and the split layout is used when
asked for (`device_resident=True` and a budget under a copy:
`_resident_data.resident_layout`): it keeps 1/replicas of the data a
device, for accelerators whose memory a copy would not fit.

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
    """Where each row of a pass comes from, per replica, in rounds.

    A replica's `m` rows of the pass are laid out in `K` rounds of `m / K`
    (the last padded), so that what a round sends and receives takes about
    `1 / K` of the dataset's share of a replica, not all of it.

    Attributes:
        send: int32 `(replicas, K, replicas, C)`: `send[s, k, d]` are the rows
            of replica `s` (local indices) that replica `d` needs in round
            `k`, padded.
        receive: int32 `(replicas, K, m / K)`: replica `d`'s rows of round
            `k`, each an index into the `replicas * C` rows it receives in
            the round (`s * C + c`), or -1 (a padding row: zeros).
        segments: static `(batches, rows)` of each output: the rows a
            replica holds of each of `batches` batches, in order.
    """

    send: np.ndarray
    receive: np.ndarray
    segments: tuple[tuple[int, int], ...]


# A round's rows a replica pair, on average, at least: the fewer, the more
# a round's chunk is padded (`_chunk_rows`).
_ROUND_PAIR_ROWS = 128


def plan_exchange(
    batches: Sequence[np.ndarray],
    replica_rows: int,
    replicas: int,
    *,
    round_rows: int | None = None,
) -> ExchangePlan:
    """Plans the layout of `batches` from rows split `replica_rows` a replica.

    Args:
        batches: groups of batches, each an int32 array `(count, rows)`
            (rows: a multiple of `replicas`; -1: padding), one output each.
        replica_rows: the dataset rows each replica holds.
        replicas: the replica count.
        round_rows: the most rows a replica lays out a round (None: all in
            one round); at least `128 * replicas`.
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
    rounds = 1
    if round_rows is not None:
        rounds = -(-m // max(round_rows, replicas * _ROUND_PAIR_ROWS))
    per_round = -(-m // rounds)
    padding = np.full((replicas, rounds * per_round - m), -1, wanted.dtype)
    wanted = np.concatenate([wanted, padding], axis=1).reshape(
        replicas, rounds, per_round
    )
    real = wanted >= 0
    source = np.where(real, wanted // replica_rows, replicas)  # Padding last.
    local = np.where(real, wanted % replica_rows, 0)
    dest, round_ = np.indices(wanted.shape)[:2]
    # Rows grouped by (destination, round, source); each row's rank in its
    # group is its place in the chunk.
    key = ((dest * rounds + round_) * (replicas + 1) + source).ravel()
    counts = np.bincount(key, minlength=replicas * rounds * (replicas + 1))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.argsort(key, kind="stable")
    rank = np.empty(key.size, np.int64)
    rank[order] = np.arange(key.size) - starts[key[order]]
    rank = rank.reshape(wanted.shape)
    most = counts.reshape(-1, replicas + 1)[:, :replicas].max(initial=0)
    chunk = _chunk_rows(int(most), per_round, replicas)
    send = np.zeros((replicas, rounds, replicas, chunk), np.int32)
    send[source[real], round_[real], dest[real], rank[real]] = local[real]
    receive = np.where(real, source * chunk + rank, -1).astype(np.int32)
    return ExchangePlan(send, receive, tuple(segments))


def _chunk_rows(most: int, m: int, replicas: int) -> int:
    """The rows of one replica-to-replica chunk: at least `most`, from a ladder.

    A replica's `m` rows of a round come about `m / replicas` from each
    replica; the first rung leaves room for four standard deviations more,
    so a shuffled pass almost always lands on it, and every pass of a `fit`
    compiles once.
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
        along the second axis, as `ResidentPlacement.lay_out_blocks` lays out.
    """
    return _exchanger(mesh, segments)(list(rows), send, receive)


@functools.cache
def _exchanger(mesh: Mesh, segments: tuple[tuple[int, int], ...]) -> Callable:
    def local(rows: list, send, receive) -> list:
        send, receive = send[0], receive[0]
        out = [_laid_out(array, send, receive) for array in rows]
        return [[_split(o, segments)[i] for o in out] for i in range(len(segments))]

    spec = PartitionSpec(_AXIS)
    blocks = PartitionSpec(None, _AXIS)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=[blocks] * len(segments),
    )
    return jax.jit(mapped)


def _laid_out(array, send, receive):
    """This replica's rows of the pass, from its `array` and the others'."""
    rounds, per_round = receive.shape
    mask_shape = (per_round,) + (1,) * (array.ndim - 1)
    zero = jnp.zeros((), array.dtype)

    def one_round(k):
        # The plan's indices are in bounds: no clamping.
        sent = array.at[send[k].reshape(-1)].get(mode="promise_in_bounds")
        got = jax.lax.all_to_all(sent, _AXIS, 0, 0, tiled=True)
        indices = receive[k]
        mine = got.at[jnp.maximum(indices, 0)].get(mode="promise_in_bounds")
        return jnp.where((indices >= 0).reshape(mask_shape), mine, zero)

    if rounds == 1:
        return one_round(0)

    def into(k, out):
        return jax.lax.dynamic_update_slice_in_dim(out, one_round(k), k * per_round, 0)

    out = jnp.zeros((rounds * per_round, *array.shape[1:]), array.dtype)
    out = jax.lax.pcast(out, _AXIS, to="varying")  # As each round's rows.
    return jax.lax.fori_loop(0, rounds, into, out)


def _split(mine, segments) -> list:
    parts, offset = [], 0
    for count, width in segments:
        part = mine[offset : offset + count * width]
        parts.append(part.reshape(count, width, *mine.shape[1:]))
        offset += count * width
    return parts
