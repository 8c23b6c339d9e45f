"""`ResidentBatch`: a step's batch as row indices into a device-resident dataset.

A `ResidentPass` (`_resident.py`) hands Keras's step, instead of the batch,
the dataset's arrays (already on every device) and the step's row indices
(split over the replicas). The one step wrapper (`training/_step.py`) makes
every step first gather the batch (`gathered`): inside the compiled
step the gather is part of the one program — no second dispatch a step, and
no program next to the step's own — and without `jit` it runs eagerly.

The indices come either as the step's own vector, or as one row of a table
of a whole pass's indices laid out once (`row`: a step number already on the
devices; `_resident.ResidentPass`), so that a step transfers nothing. A
dataset only ever read in its order needs no table: it is laid out as
blocks of batches split over the replicas (`blocked`: each device holds its
rows of each batch, not the dataset), and the batch is block `row`.

For JAX a `ResidentBatch` is a pytree of the arrays, the indices and the row
(the structure and the real-row count are static). Keras reads one batch
outside the step, to build a model (`predict` unpacks it and calls the model
on `x`; `fit` reads its shapes): Keras's own tree utilities (its `keras`
optree namespace) see the batch it stands for, gathered, its real rows
only; and a batch that is a tuple `(x, y, sample_weight)` reaches Keras as
a tuple (`keras_form`: a `ResidentTuple` of `ResidentElement`s), so that
Keras unpacks it as it unpacks the batch.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import optree

from keras_dist.data._partial_batch import as_padded_batch, unpad

__all__ = [
    "ResidentBatch",
    "ResidentTuple",
    "gathered",
    "keras_form",
]


class ResidentBatch:
    """The rows `indices` of a dataset's `arrays`, gathered in the step.

    Args:
        arrays: the dataset's arrays on every device (flattened).
        indices: int32 row indices laid out over the replicas (-1: padding),
            or, with `row`, a table of them: `(steps, rows)`, split over the
            replicas along its second axis; None when `blocked`.
        treedef: the structure of a batch (`arrays` unflattened).
        num_real: the real rows of a padded batch, or None.
        take: `strategy.take_rows`, to gather outside a step.
        row: the int32 scalar (replicated) that picks this step's row of the
            table `indices`, or its batch of a pass in order; or None.
        blocked: `arrays` are blocks of batches
            (`ResidentPlacement.lay_out_blocks`): the batch is block `row`.
    """

    def __init__(
        self,
        arrays,
        indices,
        treedef,
        num_real,
        take=None,
        row=None,
        blocked=False,
    ):
        self.arrays = tuple(arrays)
        self.indices = indices
        self.treedef = treedef
        self.num_real = num_real
        self.take = take
        self.row = row
        self.blocked = blocked

    def gather(self, take: Callable) -> Any:
        """The batch (a `PaddedBatch` when padded), gathered with `take`."""
        if self.blocked:  # A dataset read only in order: block `row`.
            rows = take(list(self.arrays), self.row, blocked=True)
        else:
            indices = self.indices if self.row is None else self.indices[self.row]
            rows = take(list(self.arrays), indices)
        return as_padded_batch(jax.tree.unflatten(self.treedef, rows), self.num_real)

    def real_batch(self) -> Any:
        """The batch it stands for, gathered with `take`: its real rows only."""
        view = self.__dict__.get("_real_batch")
        if view is None:
            view = unpad(self.gather(self.take))
            if self.num_real is not None and not _is_tuple(self.treedef):
                view = view[0]  # `as_padded_batch` put a bare batch in a tuple.
            self.__dict__["_real_batch"] = view
        return view


# Flattened by JAX's own (C++) node for these fields: a step's call passes
# its batch with no Python callback (the structure and count are static).
jax.tree_util.register_dataclass(
    ResidentBatch,
    data_fields=["arrays", "indices", "row"],
    meta_fields=["treedef", "num_real", "blocked"],
)


def _keras_flatten(batch: ResidentBatch):
    # One child, the gathered batch in its own structure (a bare array, a
    # tuple...), which Keras's tree walks in turn.
    return (batch.real_batch(),), None, None


def _keras_unflatten(_, children):
    return children[0]


def _register_for_keras(
    cls: type,
    flatten: Callable[[Any], tuple[Any, Any, Any]],
    unflatten: Callable[[Any, Any], Any],
) -> None:
    """Registers `cls` as a node of Keras's trees (optree, namespace "keras")."""
    optree.register_pytree_node(cls, flatten, unflatten, namespace="keras")


_register_for_keras(ResidentBatch, _keras_flatten, _keras_unflatten)


class ResidentElement:
    """Element `index` of a `ResidentBatch` whose batch is a tuple.

    What Keras's `unpack_x_y_sample_weight` takes out of a `ResidentTuple`
    (e.g. `x`); Keras's tree utilities see that element, gathered.
    """

    def __init__(self, batch: ResidentBatch, index: int):
        self.batch = batch
        self.index = index


class ResidentTuple(tuple):
    """A `ResidentBatch` whose batch is a tuple, as a tuple of its elements.

    Built from its items alone (`ResidentTuple(items)`), as Keras's tracking
    and tree utilities rebuild tuples. For JAX it is the `ResidentBatch`.
    """

    @property
    def batch(self) -> ResidentBatch:
        return self[0].batch


@functools.cache
def _tuple_size(treedef) -> int | None:
    """The length of a batch of structure `treedef` if it is a tuple, else None."""
    kind = treedef.node_data()
    return len(treedef.children()) if kind is not None and kind[0] is tuple else None


def _is_tuple(treedef) -> bool:
    return _tuple_size(treedef) is not None


def keras_form(batch: ResidentBatch) -> Any:
    """`batch` as Keras's loop gets it: a `ResidentTuple` if the batch is a tuple."""
    size = _tuple_size(batch.treedef)
    if size is None:
        return batch
    return ResidentTuple([ResidentElement(batch, i) for i in range(size)])


jax.tree_util.register_pytree_node(
    ResidentTuple,
    lambda form: ((form.batch,), None),
    lambda _, children: keras_form(children[0]),
)
_register_for_keras(
    ResidentTuple,
    lambda form: (tuple(form.batch.real_batch()), None, None),
    lambda _, children: tuple(children),
)
_register_for_keras(
    ResidentElement,
    lambda element: ((element.batch.real_batch()[element.index],), None, None),
    lambda _, children: children[0],
)


def gathered(value: Any, take: Callable) -> Any:
    """`value` gathered with `take` if it is a device-resident batch, else itself.

    Args:
        value: a step's argument.
        take: the running strategy's `take_rows`.
    """
    if isinstance(value, ResidentBatch):
        return value.gather(take)
    if isinstance(value, ResidentTuple):
        return value.batch.gather(take)
    return value
