"""Where a private name lives in the installed Keras, found by what exists.

keras_dist is checked against two Keras releases at once (`CHECKED_KERAS`):
the current release and the nightly of the next minor, which moved some of
the private names the seams use. Each seam names its target as the current
release has it; `find` looks that name up, and where the installed Keras no
longer has it, the name it moved to (`MOVED`), never by comparing version
strings. A name neither release has is reported by `seams()` at import.
"""

import importlib
from typing import Any

__all__ = ["MOVED", "find", "locate"]

# A private name as Keras 3.15.1 has it -> where keras-nightly
# 3.16.0.dev2026102704 has it (a prefix: a moved module moves its members);
# the first that exists is used.
MOVED: dict[str, str] = {
    "keras.src.backend.jax.core": "keras.src.backend.jax.ops.core",
    "keras.src.backend.jax.ops.core.JaxVariable": (
        "keras.src.backend.jax.ops.core.Variable"
    ),
    "keras.src.backend.jax.trainer.JAXTrainer": "keras.src.backend.jax.trainer.Trainer",
    "keras.src.trainers.trainer.Trainer": "keras.src.trainers.trainer.BaseTrainer",
    # The build of an unbuilt model that `fit`/`evaluate` call: 3.15's reads
    # the epoch iterator, the nightly's the adapter's first batch.
    "keras.src.backend.jax.trainer.JAXTrainer._symbolic_build": (
        "keras.src.backend.jax.trainer.Trainer._maybe_symbolic_build"
    ),
    # The nightly builds the per-pass iterator in `_get_iterator` itself.
    "keras.src.backend.jax.trainer.JAXEpochIterator._get_distributed_iterator": (
        "keras.src.backend.jax.trainer.JAXEpochIterator._get_iterator"
    ),
}


def _get(dotted: str) -> Any:
    """The object named `dotted` (module, then attributes), or None."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        return owner
    return None


def where(dotted: str, _seen: frozenset = frozenset()) -> str:
    """The installed location of `dotted` (itself, or where it moved)."""
    if _get(dotted) is not None:
        return dotted
    # The longest moved prefix first: a moved method before its moved class.
    for old in sorted(MOVED, key=len, reverse=True):
        if (dotted == old or dotted.startswith(old + ".")) and old not in _seen:
            moved = where(MOVED[old] + dotted[len(old) :], _seen | {old})
            if _get(moved) is not None:
                return moved
    return dotted


def find(dotted: str) -> Any:
    """The object named `dotted` as Keras 3.15 names it, wherever it is now."""
    return _get(where(dotted))


def locate(module: str, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, value) of `module.path`, wherever it is now.

    The value is None where the installed release has it nowhere; the owner
    is then the one the current release would hold it on (or None).
    """
    dotted = where(f"{module}.{path}")
    *owners, attribute = dotted.split(".")
    owner = _get(".".join(owners))
    return owner, attribute, getattr(owner, attribute, None)
