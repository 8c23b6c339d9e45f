"""The data and the evaluator's model of the SidecarEvaluator tests, shared
by tests/callbacks/test_sidecar_evaluator.py and its sidecar_script.py."""

import keras

from tests._helpers import compile_model, make_data, make_model

X, Y, _ = make_data(45)
XV, YV, _ = make_data(23, seed=5)


def evaluator_model() -> keras.Model:
    model = compile_model(make_model())
    model.optimizer.build(model.trainable_variables)  # Loads its saved state.
    return model
