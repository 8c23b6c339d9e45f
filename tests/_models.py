"""The real models of the acceptance tests: the seeds' CNN and a keras-hub GPT-2.

Shared by `tests/strategies/test_sharded_models.py` (8 devices) and
`tests/cluster/sharded_script.py` (2 processes x 4 devices). See the former
for why GPT-2 trains with Adam(epsilon=1e-4).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import keras
import keras_hub
import numpy as np

from tests._helpers import compile_model

VOCAB, SEQ = 64, 16


def cnn() -> keras.Model:
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(x))
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def gpt2() -> keras.Model:
    inputs = {
        "token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask"),
    }
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQ,
        dropout=0.0,
    )
    return keras.Model(inputs, keras.layers.Dense(VOCAB)(backbone(inputs)))


def cnn_data(n: int, seed: int):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, 28, 28, 1).astype("float32")
    return x, rng.randint(0, 10, size=n).astype("int32"), None


def token_data(n: int, seed: int):
    """Next-token prediction; each row padded after a random length."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, VOCAB, size=(n, SEQ + 1)).astype("int32")
    lengths = rng.randint(SEQ // 2, SEQ + 1, size=n)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype("int32")
    x = {"token_ids": tokens[:, :-1] * mask, "padding_mask": mask}
    return x, tokens[:, 1:], mask.astype("float32")


class Case(NamedTuple):
    build: Callable
    data: Callable
    rows: int  # Not divisible by the batch or by 8: a partial last batch.
    test_rows: int
    batch: int
    epsilon: float  # Adam's.
    atol: float


MODELS = {
    "cnn": Case(cnn, cnn_data, 45, 27, 16, epsilon=1e-7, atol=1e-6),
    "gpt2": Case(gpt2, token_data, 29, 27, 16, epsilon=1e-4, atol=5e-6),
}


@functools.cache
def initial_weights(model_name: str) -> tuple:
    keras.utils.set_random_seed(1234)
    return tuple(MODELS[model_name][0]().get_weights())


def run_case(model_name: str, strategy):
    """fit (2 epochs), evaluate, predict of `MODELS[model_name]` under `strategy`.

    Returns:
        (model, history dict, evaluate result, predictions).
    """
    case = MODELS[model_name]
    with strategy.scope():
        model = case.build()
        model.set_weights(list(initial_weights(model_name)))
        compile_model(model, keras.optimizers.Adam(epsilon=case.epsilon))
    x, y, sw = case.data(case.rows, seed=0)
    batch = case.batch
    history = model.fit(
        x, y, sample_weight=sw, batch_size=batch, epochs=2, shuffle=False, verbose=0
    )
    xt, yt, swt = case.data(case.test_rows, seed=2)
    evaluated = model.evaluate(xt, yt, sample_weight=swt, batch_size=batch, verbose=0)
    predicted = model.predict(xt, batch_size=batch, verbose=0)
    return model, history.history, evaluated, predicted
