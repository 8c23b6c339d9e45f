"""keras-hub's `CausalLM.generate` under every strategy, inside its scope.

`generate` lays its prompts out itself (`get_data_layout(prompts.shape)`,
then `keras.distribution.distribute_tensor`), outside `fit`: 1, 3 and N+1
prompts (N: the replicas), a single string, strings through a real
preprocessor (a SentencePiece model trained here, in keras-hub's
`GemmaTokenizer` and `GemmaCausalLMPreprocessor`), the greedy and a seeded
top-k sampler and `stop_token_ids` must give one device's tokens, token for
token. `fit` on raw strings (keras-hub's own input path, a Grain dataset) with a partial
last batch must give one device's losses and weights.
"""

import keras
import keras_hub
import numpy as np
import pytest

import keras_dist as kd
from tests import _keras_hub_lm as lm
from tests._keras_hub_lm import SEQ
from tests._strategies import STRATEGIES


@pytest.fixture(scope="module")
def proto():
    return lm.train_proto()


# ZeRO-1 lays its variables out as Mirrored does (it splits optimizer slots,
# which `generate` never reads): left out.
GENERATE_STRATEGIES = {
    **{name: make for name, make in STRATEGIES.items() if name != "zero1"},
    "model_parallel_2": lambda: kd.MirroredStrategy(model_parallel=2),
    "model_parallel_4": lambda: kd.MirroredStrategy(model_parallel=4),
    "model_parallel_8": lambda: kd.MirroredStrategy(model_parallel=8),
    "keras_hub_layout_map": lambda: kd.MirroredStrategy(
        model_parallel=4, layout_map=keras_hub.models.GemmaBackbone.get_layout_map
    ),
}


@pytest.fixture(scope="module")
def reference(proto):
    return lm.gemma(proto)


@pytest.fixture(scope="module", params=list(GENERATE_STRATEGIES))
def strategy_and_model(request, proto, reference):
    strategy = GENERATE_STRATEGIES[request.param]()
    with strategy.scope():
        model = lm.gemma(proto)
    # Keras's own initial values on every strategy: compare what `generate`
    # does, from the very same weights.
    model.set_weights(reference.get_weights())
    return strategy, model


def _prompt_counts(strategy):
    """Fewer prompts than replicas (one: padded to a row a replica) and one
    more than the replicas (padded to two rows a replica); each count is
    another program to compile, so no more (3 prompts on 8 replicas took
    the path 1 takes)."""
    return sorted({1, strategy.num_replicas_in_sync + 1})


def test_generate_on_token_ids_gives_one_devices_tokens(strategy_and_model, reference):
    strategy, model = strategy_and_model
    for n in _prompt_counts(strategy):
        prompts = lm.token_prompts(n)
        with strategy.scope():
            got = lm.generate_tokens(model, prompts)
        want = lm.generate_tokens(reference, prompts)
        np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
        np.testing.assert_array_equal(got["padding_mask"], want["padding_mask"])
        assert got["padding_mask"].sum() > prompts["padding_mask"].sum()  # New.


# The samplers on one strategy of each variable layout (whole on one device,
# replicated, split by a partitioner, on a 2-D mesh automatic and keras-hub's):
# the layouts are what `generate` distributes, each tested above with greedy.
@pytest.mark.parametrize(
    "strategy_and_model",
    ["one_device", "mirrored", "parameter_server", "model_parallel_4",
     "keras_hub_layout_map"],
    indirect=True,
)  # fmt: skip
def test_seeded_top_k_and_stop_token_ids_give_one_devices_tokens(
    strategy_and_model, reference
):
    strategy, model = strategy_and_model
    prompts = lm.token_prompts(3)
    want = lm.generate_tokens(reference, prompts, lm.top_k())
    with strategy.scope():
        got = lm.generate_tokens(model, prompts, lm.top_k())
    np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
    # A token the greedy run generates in its first row: stop there.
    greedy = lm.generate_tokens(reference, prompts)
    first = int(prompts["padding_mask"][0].sum())
    stop = (int(greedy["token_ids"][0, first + 1]),)
    want = lm.generate_tokens(reference, prompts, stop_token_ids=stop)
    assert want["padding_mask"][0].sum() < SEQ  # It stopped early.
    with strategy.scope():
        got = lm.generate_tokens(model, prompts, stop_token_ids=stop)
    np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
    np.testing.assert_array_equal(got["padding_mask"], want["padding_mask"])


def test_generate_on_strings_through_the_preprocessor(strategy_and_model, reference):
    strategy, model = strategy_and_model
    prompts = lm.sentences(strategy.num_replicas_in_sync + 1, seed=5)
    for inputs in (prompts, prompts[:3], prompts[0]):  # N+1, 3, a single string
        want = reference.generate(inputs, stop_token_ids=None)
        with strategy.scope():
            got = model.generate(inputs, stop_token_ids=None)
        assert got == want
        if isinstance(inputs, str):
            assert isinstance(got, str) and len(got.split()) > len(inputs.split())
        else:
            assert len(got) == len(inputs)


# fit on raw strings through keras-hub's preprocessor --------------------------


def _fit_on_strings(strategy, proto):
    with strategy.scope():
        model = lm.gemma(proto)
    # 37 sentences, batch 8: a partial last batch of 5.
    history = model.fit(lm.sentences(37, seed=1), batch_size=8, epochs=2, verbose=0)
    with strategy.scope():
        generated = model.generate(lm.sentences(3, seed=7), stop_token_ids=None)
    return model, history.history, generated


@pytest.fixture(scope="module")
def strings_reference(proto):
    return _fit_on_strings(kd.OneDeviceStrategy("cpu:0"), proto)


@pytest.mark.parametrize(
    "make",
    [kd.MirroredStrategy, lambda: kd.MirroredStrategy(model_parallel=4)],
    ids=["mirrored", "model_parallel_4"],
)
def test_fit_on_raw_strings_equals_one_device(strings_reference, proto, make):
    model, history, generated = _fit_on_strings(make(), proto)
    want_model, want_history, want_generated = strings_reference
    np.testing.assert_allclose(history["loss"], want_history["loss"], rtol=1e-4)
    np.testing.assert_allclose(history["accuracy"], want_history["accuracy"], rtol=1e-4)
    for got, want in zip(model.get_weights(), want_model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert generated == want_generated


# Other CausalLMs: Llama's own generate step, a Seq2SeqLM (BART) ----------------


def _llama():
    return lm.llama(lm.VOCAB, seed=2)


def _bart():
    keras.utils.set_random_seed(2)
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=lm.VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)


def _bart_prompts(n):
    tokens = lm.token_prompts(n)
    decoder = np.zeros((n, SEQ), "int32")
    decoder[:, 0] = 2  # BART's decoder starts from its end token.
    return {
        "encoder_token_ids": tokens["token_ids"],
        "encoder_padding_mask": tokens["padding_mask"],
        "decoder_token_ids": decoder,
        "decoder_padding_mask": decoder != 0,
    }


@pytest.mark.parametrize("kind", ["llama", "bart"])
@pytest.mark.parametrize(
    "make",
    [kd.MirroredStrategy, lambda: kd.MirroredStrategy(model_parallel=4)],
    ids=["mirrored", "model_parallel_4"],
)
def test_other_causal_lms_generate_one_devices_tokens(kind, make):
    build, prompts_of = {
        "llama": (_llama, lm.token_prompts),
        "bart": (_bart, _bart_prompts),
    }[kind]
    reference = build()
    reference.compile(sampler="greedy")
    strategy = make()
    with strategy.scope():
        model = build()
        model.compile(sampler="greedy")
    model.set_weights(reference.get_weights())
    # N+1 prompts (a partial batch): the other counts are Gemma's tests above.
    for n in (strategy.num_replicas_in_sync + 1,):
        prompts = prompts_of(n)
        want = reference.generate(prompts, stop_token_ids=None)
        with strategy.scope():
            got = model.generate(prompts, stop_token_ids=None)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
