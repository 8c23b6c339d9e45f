"""A long fit of a small model on 8 CPU devices (tests/strategies/test_pacing.py).

    python pacing_script.py STEPS [unpaced]   (one epoch of STEPS steps)

`unpaced` lets the host run ahead without bound (the control: XLA:CPU then
aborts the process in its all-reduce rendezvous).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["KERAS_BACKEND"] = "jax"

import keras
import numpy as np

import keras_dist as kd
from keras_dist.strategies.placement import _placement

steps = int(sys.argv[1])
if "unpaced" in sys.argv[2:]:
    _placement.DEPTH = 10**9
rng = np.random.RandomState(0)
x = rng.rand(16 * steps, 28, 28, 1).astype("float32")
y = rng.randint(0, 10, size=16 * steps).astype("int32")
with kd.MirroredStrategy().scope():
    model = keras.Sequential(
        [keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
print("DONE", history.history["loss"][-1], flush=True)
print(f"PJRT_NPROC={os.environ.get('PJRT_NPROC')}", flush=True)
