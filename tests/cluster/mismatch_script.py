"""A 2-process run whose rank 1 makes a different call (KD_MISMATCH).

`batch`: rank 1 passes another global batch size; `model`: rank 1 builds a
wider model. keras_dist must stop both with an error, not hang.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=30)
)

import jax  # noqa: E402
import keras  # noqa: E402

from tests._helpers import compile_model, make_data  # noqa: E402

odd = jax.process_index() == 1
kind = os.environ["KD_MISMATCH"]
x, y, _ = make_data(64)
with strategy.scope():
    width = 32 if odd and kind == "model" else 16
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(width), keras.layers.Dense(3)]
    )
    compile_model(model)
batch_size = 16 if odd and kind == "batch" else 32
model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
print("no error", flush=True)
