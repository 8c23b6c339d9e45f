"""A tiny keras-hub Gemma with a real tokenizer, for `generate` tests.

The SentencePiece model is trained offline from generated sentences, as
keras-hub's `GemmaTokenizer` docs show; the same calls give the same model
in every process (tests/cluster/mwms_script.py).
"""

import io

import keras
import keras_hub
import numpy as np
import sentencepiece

SEQ = 12
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "and",
    "ran",
    "far",
]
VOCAB = len(WORDS) + 4  # and <pad>, <bos>, <eos>, <unk>


def sentences(n, seed):
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(WORDS, rng.randint(2, 9))) for _ in range(n)]


def train_proto() -> bytes:
    """A SentencePiece model trained offline, as keras-hub's docs show."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(200, seed=0)),
        model_writer=model,
        vocab_size=VOCAB,
        model_type="WORD",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        bos_piece="<bos>",
        eos_piece="<eos>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    return model.getvalue()


def gemma(proto):
    keras.utils.set_random_seed(1)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
    )
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=SEQ
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)
    compile_lm(model, "greedy")
    return model


def llama(vocabulary_size, seed=1):
    """A tiny keras-hub Llama (grouped-query attention), no preprocessor."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocabulary_size,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,  # Grouped-query attention.
        hidden_dim=64,
        intermediate_dim=128,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def compile_lm(model, sampler):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        sampler=sampler,
    )


def top_k():
    return keras_hub.samplers.TopKSampler(k=4, seed=42)


def token_prompts(n, seed=3):
    rng = np.random.RandomState(seed + n)
    lengths = rng.randint(1, 5, size=n)
    ids = rng.randint(4, VOCAB, size=(n, SEQ)).astype("int32")
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    return {"token_ids": np.where(mask, ids, 0).astype("int32"), "padding_mask": mask}


def generate_tokens(model, prompts, sampler="greedy", stop_token_ids=None):
    """`generate` on token ids, the preprocessor detached for the call."""
    preprocessor = model.preprocessor
    model.preprocessor = None
    compile_lm(model, sampler)
    try:
        return model.generate(prompts, stop_token_ids=stop_token_ids)
    finally:
        model.preprocessor = preprocessor
        compile_lm(model, "greedy")
