"""`BatchGroup`: the N batches of one `steps_per_execution` group, for one program.

A group of batches of one structure runs as one compiled program
(`training/_fused_steps.py`): the leaves every batch shares (the same
object: the dataset of device-resident input) go in once, the others are
stacked along a new leading axis of length N. An input that lays a whole
group out at once hands over leaves already stacked on the devices — one
transfer for N steps: a device-resident pass its indices
(`_resident.ResidentPass.next_group`), the host pipeline its N host batches
stacked on its thread (`host/_pipeline.InputPass.next_group`). Batches read
one by one (`read_group`) are stacked inside the program.
"""

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

__all__ = ["BatchGroup", "alike", "columns_of", "group_of", "grouped", "read_group"]


@dataclasses.dataclass(frozen=True)
class BatchGroup:
    """N batches of one structure, as the arguments of one program.

    Attributes:
        treedef: the structure of one batch (`jax.tree.flatten`).
        is_shared: per leaf of a batch, whether every batch has that leaf.
        shared: the shared leaves, in order.
        varying: the other leaves, in order: each a tuple of the N batches'
            arrays, or one array with a leading axis of N (already stacked).
    """

    treedef: Any
    is_shared: tuple[bool, ...]
    shared: tuple
    varying: tuple

    def batch(self, rows: list) -> Any:
        """One batch: the shared leaves with `rows`, one step's varying leaves."""
        shared, varying = iter(self.shared), iter(rows)
        leaves = [next(shared) if same else next(varying) for same in self.is_shared]
        return jax.tree.unflatten(self.treedef, leaves)

    def batches(self, count: int) -> list:
        """The group's `count` batches, one by one, for a loop of one-step calls.

        A tuple leaf gives back its arrays; a stacked one is sliced on the
        devices.
        """
        return [self.batch([v[i] for v in self.varying]) for i in range(count)]


def read_group(iterator: Iterator, count: int) -> "BatchGroup | list":
    """The next `count` batches of `iterator`, read one by one as Keras's loop.

    As in Keras: the first batch must exist (`StopIteration` ends the
    epoch), the others may be missing. A list when they cannot be fused.
    """
    batches = [next(iterator)]
    for _ in range(count - 1):
        batch = next(iterator, _END)
        if batch is _END:
            break
        batches.append(batch)
    return grouped(batches, count)


def grouped(batches: list, count: int) -> "BatchGroup | list":
    """`batches` as a group when they are `count` that can run as one program,
    else the list."""
    group = group_of(batches) if len(batches) == count else None
    return batches if group is None else group


_END = object()


def group_of(batches: list) -> BatchGroup | None:
    """`batches` as a group, or None when they cannot run as one program.

    They can when they have one structure and each leaf is either the same
    object in all of them or a `jax.Array` of one shape and dtype.
    """
    found = columns_of(batches)
    if found is None:
        return None
    treedef, columns = found
    is_shared = tuple(all(leaf is column[0] for leaf in column) for column in columns)
    shared, varying = [], []
    for column, same in zip(columns, is_shared, strict=True):
        if same:
            shared.append(column[0])
        elif alike(column, jax.Array):
            varying.append(tuple(column))
        else:
            return None
    return BatchGroup(treedef, is_shared, tuple(shared), tuple(varying))


def columns_of(batches: list) -> tuple[Any, list[tuple]] | None:
    """`(treedef, columns)`: the batches' one structure and, per leaf, the
    batches' arrays of it; None when their structures differ."""
    flat = [jax.tree.flatten(batch) for batch in batches]
    treedef: jax.tree_util.PyTreeDef = flat[0][1]
    if any(other != treedef for _, other in flat[1:]):
        return None
    return treedef, list(zip(*(leaves for leaves, _ in flat), strict=True))


def alike(column: tuple, kind: Any) -> bool:
    """Whether every leaf of `column` is a `kind` of the first's shape and dtype."""
    first = column[0]
    return all(
        isinstance(leaf, kind)
        and leaf.shape == first.shape
        and leaf.dtype == first.dtype
        for leaf in column
    )
