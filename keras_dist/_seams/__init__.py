"""The seams: what keras_dist changes in Keras, on the top floor.

What the public API cannot express is done here, on Keras's JAX trainer,
variables, optimizers, data adapters and saving calls (`_install.py` lists
every wrapped function in `_SEAMS` and installs them, from
`keras_dist/__init__.py`). `_trainer.py` drives `fit`, `evaluate` and
`predict`: Keras's per-pass iterator and step builders, connected to the
input pipeline (`keras_dist/data/`) and the step wrapper
(`keras_dist/training/`). The seams import every layer below them; no layer
imports them. The private names of other packages that the layers below
need are read in `keras_dist/_private_api/`, the fence's ground floor.

Its attributes (`install`, `seams`, `_SEAMS`, ...) are `_install.py`'s,
loaded when first asked for.
"""

import importlib
import importlib.util
from typing import Any


def __getattr__(name: str) -> Any:
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    seams = importlib.import_module(f"{__name__}._install")
    try:
        value = getattr(seams, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # Found once: later reads are plain attributes.
    return value
