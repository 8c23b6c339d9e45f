"""Batches of one pass must keep their structure, rank and dtype."""

from typing import Any

import jax
import numpy as np

__all__ = ["BatchSignature"]


def _describe(leaf) -> tuple:
    return (np.ndim(leaf), np.dtype(getattr(leaf, "dtype", type(leaf))).name)


class BatchSignature:
    """Remembers the first batch of a pass; refuses batches that differ.

    The batch size may change (a partial last batch) and so may the other
    dimensions (each new shape compiles a new step); a change of structure,
    rank or dtype mid-pass is a bug in the input pipeline and would otherwise
    surface as an opaque error from inside the compiled step.

    Args:
        source: what produces the batches, for error messages.
    """

    def __init__(self, source: str):
        self._source = source
        self._key = None
        self._first = None

    def check(self, batch: Any, index: int) -> None:
        """Raises ValueError if `batch` (the `index`-th) differs from the first."""
        # Runs for every batch: compare a cheap key; describe only on mismatch.
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple(_describe(leaf) for leaf in leaves))
        if self._key is None:
            self._key, self._first = key, self._signature(batch)
            return
        if key != self._key:
            self._explain(self._signature(batch), index)

    @staticmethod
    def _signature(batch: Any) -> tuple:
        paths = jax.tree_util.tree_flatten_with_path(batch)[0]
        return tuple(
            (jax.tree_util.keystr(path), *_describe(leaf), np.shape(leaf))
            for path, leaf in paths
        )

    def _explain(self, signature: tuple, index: int) -> None:
        first_keys = [s[:3] for s in self._first]
        keys = [s[:3] for s in signature]
        if first_keys == keys:
            return
        first = {s[0]: s for s in self._first}
        for entry in signature:
            old = first.get(entry[0])
            if old is None or old[1:3] != entry[1:3]:
                was = "absent" if old is None else f"shape {old[3]}, dtype {old[2]}"
                raise ValueError(
                    f"Batch {index} of {self._source} does not match batch 0: "
                    f"element {entry[0] or '(the batch)'} has shape {entry[3]} and "
                    f"dtype {entry[2]}, but was {was} in batch 0. Every batch of an "
                    "epoch must have the same structure, rank and dtype; make "
                    "the dataset yield uniform batches (pad or cast them)."
                )
        raise ValueError(
            f"Batch {index} of {self._source} does not match batch 0: its "
            f"elements are {[k[0] for k in keys]}, batch 0 had "
            f"{[k[0] for k in first_keys]}. Every batch of an epoch must have "
            "the same structure."
        )
