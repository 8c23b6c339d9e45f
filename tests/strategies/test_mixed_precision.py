"""mixed_float16 under every strategy: the same skipped steps and loss scales.

The run starts at a loss scale of 2**18, where the scaled gradients overflow
float16: every strategy must skip the same steps, halve and grow the scale at
the same batches and end with the `dynamic_scale`, `step_counter` and
`iterations` of one device, with weights, losses and outputs within rtol
1e-3 (tolerances: tests/strategies/_mixed_precision.py).
"""

import keras
import pytest

from tests.strategies._mixed_precision import (
    DISTRIBUTED,
    assert_matches_one_device,
    float32_policy_after,  # noqa: F401 (autouse fixture)
    run,
)


def test_the_one_device_reference_overflows_skips_and_grows():
    model, _, seen, _, _ = run("one_device", "float16_lso_overflow")
    scales = [s for s, _, _ in seen]
    iterations = [i for _, _, i in seen]
    assert scales[:3] == [2.0**17, 2.0**16, 2.0**15]  # 3 overflows: halved...
    assert iterations[:3] == [0, 0, 0]  # ... and skipped.
    assert 2.0**16 in scales[3:]  # Grown after 2 finite steps.
    assert 0 < iterations[-1] < len(seen) == 8
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[0].kernel.dtype == "float32"
    assert keras.mixed_precision.global_policy().name == "float32"


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_overflowing_float16_fit_matches_one_device(name):
    assert_matches_one_device(name, "float16_lso_overflow")


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_auto_scale_loss_matches_one_device(name):
    """compile(auto_scale_loss=True), Keras's default, wraps Adam in the scaler."""
    model, _, seen, _, _ = run("one_device", "float16_auto_scale_loss")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert seen[-1] == (2.0**15, 8, 8)  # Keras's defaults: no overflow here.
    assert_matches_one_device(name, "float16_auto_scale_loss")
