"""Sharded strategies on real models: the seeds' CNN and a keras-hub GPT-2.

`test_sharded.py` proves the rules on a small MLP; this file is the
acceptance on the models users bring. Every strategy that splits state over
the 8 devices (`ParameterServerStrategy(FixedShardsPartitioner(8))`, FSDP,
ZeRO-1, and `CentralStorageStrategy`, which keeps it in host memory) must
give the numbers of `OneDeviceStrategy` for `fit` (2 epochs), `evaluate` and
`predict`, with partial last batches (CNN 45 rows, GPT-2 29, both 27 to
evaluate and predict, batch 16: last batches of 13 and 11 rows), and ZeRO-1
the bits of plain `MirroredStrategy`.

The models: the seeds' MNIST CNN on 28x28x1 (Conv2D 32 -> MaxPool -> Dense
64 -> Dense 10) and `keras_hub.models.GPT2Backbone` (1 layer, hidden 16,
vocabulary 64, random weights, dropout 0 so every run draws no random
numbers) under a Dense head, trained on next-token prediction with the
padding mask as sample weight. Every run starts from the same weights.

GPT-2 trains with Adam(epsilon=1e-4) and is compared with atol 5e-6: the
attention's key bias has a gradient that is zero mathematically (softmax is
shift-invariant), so what it gets is float noise (~1e-9) that differs with
every summation order, and Adam with its default epsilon (1e-7) turns that
noise into updates of ~1e-5 per step; the runs would then differ by Adam's
amplification of noise (weights by 1.4e-6 after 6 steps, logits by 2e-5),
not by the strategy. With epsilon 1e-4 the weights of every run agree to
6e-8 and the logits (magnitude ~1, through two transformer blocks) to 2.3e-6,
as plain MirroredStrategy's (1.3e-6).
"""

import functools

import numpy as np
import pytest

from keras_dist.strategies._base import strategy_of_model
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
)
from tests._models import MODELS, run_case
from tests._strategies import STRATEGIES

SHARDED = ["parameter_server", "fsdp"]
COMPARED = [n for n in STRATEGIES if n not in ("one_device", "mirrored")]


@functools.cache
def _run(model_name: str, strategy_name: str):
    return run_case(model_name, STRATEGIES[strategy_name]())


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", COMPARED)
def test_matches_one_device(model_name, name):
    model, history, evaluated, predicted = _run(model_name, name)
    ref_model, ref_history, ref_evaluated, ref_predicted = _run(
        model_name, "one_device"
    )
    atol = MODELS[model_name].atol
    assert_history_close(ref_history, history, atol=atol)
    np.testing.assert_allclose(evaluated, ref_evaluated, rtol=1e-5, atol=atol)
    assert predicted.shape == ref_predicted.shape
    np.testing.assert_allclose(predicted, ref_predicted, rtol=1e-5, atol=atol)
    assert_weights_close(ref_model.get_weights(), model.get_weights(), atol=atol)


@pytest.mark.parametrize("model_name", MODELS)
def test_zero1_is_bit_identical_to_mirrored(model_name):
    model, history, evaluated, predicted = _run(model_name, "zero1")
    ref_model, ref_history, ref_evaluated, ref_predicted = _run(model_name, "mirrored")
    for a, b in zip(ref_model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    assert history == ref_history
    np.testing.assert_array_equal(evaluated, ref_evaluated)
    np.testing.assert_array_equal(predicted, ref_predicted)


def _bytes_per_device(shape: tuple, itemsize: int, *, split: bool) -> int:
    """By hand: 1/8 of the bytes when split along a dimension divisible by 8."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if split and shape and any(d % 8 == 0 for d in shape):
        return nbytes // 8
    return nbytes


def _held_by_each_device(variable) -> list[int]:
    held = {}
    for shard in variable.value.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return list(held.values())


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", SHARDED)
def test_each_device_holds_one_eighth_of_the_sharded_state(model_name, name):
    model = _run(model_name, name)[0]
    report = strategy_of_model(model).memory_report(model)
    weights = {v.path: v for v in model.weights}
    sharded = 0
    for row in report.variables:
        if row.axis is not None:
            sharded += 1
            assert row.parts == 8, row.path
            assert row.bytes_per_device * 8 == row.nbytes, row.path
        variable = weights.get(row.path)
        if variable is not None:
            assert _held_by_each_device(variable) == [row.bytes_per_device] * 8
    # Every weight with a dimension divisible by 8 (all but the 10-class
    # bias of the CNN), and its two Adam moments.
    trainable = model.trainable_weights
    divisible = [v for v in trainable if any(d % 8 == 0 for d in v.shape)]
    assert len(divisible) >= len(trainable) - 1
    assert sharded == 3 * len(divisible)
    by_hand = sum(
        _bytes_per_device(tuple(v.shape), 4, split=True) for v in model.weights
    )
    assert report.weight_bytes_per_device == by_hand < report.weight_bytes
    # Adam: iteration and learning rate (4-byte scalars), two moments each.
    slots = sum(_bytes_per_device(tuple(v.shape), 4, split=True) for v in trainable)
    assert report.optimizer_bytes_per_device == 8 + 2 * slots
    assert report.optimizer_bytes_per_device < report.optimizer_bytes


@pytest.mark.parametrize("model_name", MODELS)
def test_zero1_splits_only_the_optimizer_state(model_name):
    model = _run(model_name, "zero1")[0]
    report = strategy_of_model(model).memory_report(model)
    assert report.weight_bytes_per_device == report.weight_bytes
    slots = sum(
        _bytes_per_device(tuple(v.shape), 4, split=True)
        for v in model.trainable_weights
    )
    assert report.optimizer_bytes_per_device == 8 + 2 * slots
    assert report.optimizer_bytes_per_device < report.optimizer_bytes / 4
