"""mixed_bfloat16 with a LossScaleOptimizer under every strategy equals one device.

Weights within rtol 1e-2 (bfloat16 has an 8-bit mantissa; the summation
order over replicas differs), the loss scale grown at the same batches and
the same final `dynamic_scale`, `step_counter` and `iterations`
(tolerances: tests/strategies/_mixed_precision.py).
"""

import pytest

from tests.strategies._mixed_precision import (
    DISTRIBUTED,
    assert_matches_one_device,
    float32_policy_after,  # noqa: F401 (autouse fixture)
    run,
)


def test_the_one_device_reference_computes_in_bfloat16():
    model, _, seen, _, predicted = run("one_device", "bfloat16_lso")
    assert model.layers[0].compute_dtype == "bfloat16"
    assert model.layers[0].kernel.dtype == "float32"
    assert predicted.dtype == "bfloat16"
    assert seen[-1] == (2.0**19, 0, 8)  # Doubled every 2 steps, nothing skipped.


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_bfloat16_fit_matches_one_device(name):
    assert_matches_one_device(name, "bfloat16_lso")
