"""Make sure Keras runs on JAX before anything else is imported."""

import os
import sys


def ensure_jax_backend() -> None:
    """Selects the JAX backend if Keras is not loaded yet; fails if it is not JAX.

    Raises:
        ImportError: if Keras was already imported with another backend.
    """
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise ImportError(
            "keras_dist runs Keras on the JAX backend, but Keras was loaded "
            f"with another one. Received: backend={backend!r}. Set "
            "`KERAS_BACKEND=jax` in the environment (or import keras_dist "
            "before keras), e.g. `KERAS_BACKEND=jax python train.py`."
        )
