"""The fence: the one package where keras_dist reaches into private names.

Two parts, both listed in the seam tables (`_private.py`) and checked at
import:

- the seams (`_seams.py`, installed from `keras_dist/__init__.py`): what
  keras_dist changes in Keras's JAX trainer, variables and optimizers, with
  the tables every private name is listed in;
- the accessors (`_access.py`, `_jax_private.py`, `_tf_private.py`): the
  private reads other layers need, behind functions with public names.
  They import nothing of keras_dist, so any layer may call them.

This module is light: its attributes (`install`, `seams`, `_SEAMS`, ...)
load `_seams.py` when first asked for, so importing an accessor from a lower
layer does not pull in the seams (which import every layer).
"""

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    seams = importlib.import_module(f"{__name__}._seams")
    try:
        value = getattr(seams, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # Found once: later reads are plain attributes.
    return value
