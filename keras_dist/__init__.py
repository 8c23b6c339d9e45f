"""keras_dist: the tf.distribute experience for Keras 3 on JAX.

```python
import keras, keras_dist as kd
strategy = kd.MirroredStrategy()
with strategy.scope():
    model = make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64)    # global batch, split over the replicas
```
"""

from keras_dist._backend import ensure_jax_backend as _ensure_jax_backend
from keras_dist._backend import size_cpu_thread_pool as _size_cpu_thread_pool

_ensure_jax_backend()
_size_cpu_thread_pool()  # Several CPU devices: before JAX starts its client.

from keras_dist import (  # noqa: E402
    _seams,
    callbacks,
    cluster,
    data,
    errors,
    failure_handling,
    layers,
    losses,
    partitioners,
    tpu,
    utils,
)
from keras_dist._version import __version__  # noqa: E402
from keras_dist.data import InputContext, InputOptions  # noqa: E402
from keras_dist.failure_handling import (  # noqa: E402
    PreemptionCheckpointHandler,
    TerminationConfig,
)
from keras_dist.strategies import *  # noqa: E402, F403 (its names are kd's)
from keras_dist.strategies import __all__ as _strategy_names  # noqa: E402
from keras_dist.tpu import TPUStrategy  # noqa: E402

# The private Keras seams (inert unless a keras_dist strategy is in use).
_seams.install()

__all__ = [
    *_strategy_names,
    "InputContext",
    "InputOptions",
    "PreemptionCheckpointHandler",
    "TPUStrategy",
    "TerminationConfig",
    "__version__",
    "callbacks",
    "cluster",
    "data",
    "errors",
    "failure_handling",
    "layers",
    "losses",
    "partitioners",
    "tpu",
    "utils",
]
