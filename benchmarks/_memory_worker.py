"""One configuration of `memory.py`, run in a fresh process; prints one JSON line.

    python benchmarks/_memory_worker.py CONFIG MODEL STEPS REPEATS

CONFIG is one of `memory.CONFIGS` (one_device, mirrored, zero1, fsdp, ps,
central_storage); MODEL one of `MODELS` below. Trains a keras-hub
`GPT2Backbone` under a Dense head on synthetic next-token data for
1 + REPEATS epochs of STEPS steps (the first epoch, with compilation, is not
timed), then prints `RESULT {json}`: the ms/step of each timed epoch, the
final loss and the numbers of `strategy.memory_report(model)`.
"""

import os
import resource
import sys

from _runs import force_host_devices, print_result

CONFIG, MODEL = sys.argv[1], sys.argv[2]
STEPS, REPEATS = int(sys.argv[3]), int(sys.argv[4])
force_host_devices(8)
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from _timing import EpochTimer  # noqa: E402

import keras_dist as kd  # noqa: E402

# min_shard_bytes: ParameterServerStrategy's MinSizePartitioner splits what is
# at least twice as big (the embeddings, the attention and MLP kernels).
MODELS = {
    "gpt2": dict(vocab=8192, hidden=256, layers=4, heads=4, seq=128, batch=8,
                 min_shard_bytes=128 << 10),
    "gpt2-small": dict(vocab=2048, hidden=128, layers=2, heads=2, seq=64, batch=8,
                       min_shard_bytes=16 << 10),
    "tiny": dict(vocab=64, hidden=16, layers=1, heads=2, seq=16, batch=8,
                 min_shard_bytes=256),
}  # fmt: skip
SPEC = MODELS[MODEL]


def make_strategy():
    eight = kd.MirroredStrategy().devices[:8]
    partitioner = kd.partitioners.MinSizePartitioner(
        min_shard_bytes=SPEC["min_shard_bytes"], max_shards=8
    )
    return {
        "one_device": lambda: kd.OneDeviceStrategy(eight[0]),
        "mirrored": lambda: kd.MirroredStrategy(eight),
        "zero1": lambda: kd.MirroredStrategy(eight, shard_optimizer_state=True),
        "fsdp": lambda: kd.MirroredStrategy(eight, shard_variables=True),
        "ps": lambda: kd.ParameterServerStrategy(variable_partitioner=partitioner),
        "central_storage": lambda: kd.CentralStorageStrategy(eight),
    }[CONFIG]()


def make_model():
    seq = SPEC["seq"]
    inputs = {
        "token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask"),
    }
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=SPEC["vocab"],
        num_layers=SPEC["layers"],
        num_heads=SPEC["heads"],
        hidden_dim=SPEC["hidden"],
        intermediate_dim=4 * SPEC["hidden"],
        max_sequence_length=seq,
        dropout=0.0,
    )
    model = keras.Model(inputs, keras.layers.Dense(SPEC["vocab"])(backbone(inputs)))
    # The same weights in every process, without seeding TensorFlow.
    rng = np.random.RandomState(1)
    for v in model.weights:
        if v.path.endswith("gamma"):
            v.assign(np.ones(v.shape, "float32"))
        elif len(v.shape) >= 2:
            v.assign(rng.normal(0, 0.02, v.shape).astype("float32"))
        else:
            v.assign(np.zeros(v.shape, "float32"))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_data():
    rng = np.random.RandomState(0)
    n, seq = STEPS * SPEC["batch"], SPEC["seq"]
    tokens = rng.randint(1, SPEC["vocab"], size=(n, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), "int32")}
    return x, tokens[:, 1:]


def main():
    strategy = make_strategy()
    with strategy.scope():
        model = make_model()
    x, y = make_data()
    timer = EpochTimer()
    history = model.fit(
        x,
        y,
        batch_size=SPEC["batch"],
        epochs=1 + REPEATS,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    report = strategy.memory_report(model)
    print(report, file=sys.stderr)
    print_result(
        {
            "config": CONFIG,
            "model": MODEL,
            "spec": SPEC,
            "params": model.count_params(),
            "steps": STEPS,
            "first_epoch_s": timer.seconds[0],
            "ms_per_step": [s / STEPS * 1e3 for s in timer.seconds[1:]],
            "final_loss": float(history.history["loss"][-1]),
            "weight_bytes": report.weight_bytes,
            "optimizer_bytes": report.optimizer_bytes,
            "weight_bytes_per_device": report.weight_bytes_per_device,
            "optimizer_bytes_per_device": report.optimizer_bytes_per_device,
            "host_bytes_per_device": report.host_bytes_per_device,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )


if __name__ == "__main__":
    main()
