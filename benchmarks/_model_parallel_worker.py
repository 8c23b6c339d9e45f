"""One configuration of `model_parallel.py`, in a fresh process; prints one JSON line.

    python benchmarks/_model_parallel_worker.py CONFIG MODEL STEPS REPEATS

CONFIG is one of `model_parallel.CONFIGS`; MODEL one of `MODELS` below.
Trains a keras-hub `GemmaCausalLM` (random weights from a config, synthetic
next-token data, Adam) for 1 + REPEATS epochs of STEPS steps under the
configuration, with `kd.utils.ScalingReport` (step time, and the compiled
step's FLOPs and collective bytes), then prints `RESULT {json}` with the
numbers of `strategy.memory_report(model)`.
"""

import os
import resource
import sys

from _runs import force_host_devices, print_result

CONFIG, MODEL = sys.argv[1], sys.argv[2]
STEPS, REPEATS = int(sys.argv[3]), int(sys.argv[4])
PLATFORM = force_host_devices(8)
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from _timing import EpochTimer  # noqa: E402

import keras_dist as kd  # noqa: E402

MODELS = {
    # The Gemma-style model: 4 layers, hidden 512 (GQA: 2 KV heads).
    "gemma": dict(vocab=4096, layers=4, hidden=512, heads=8, kv_heads=2,
                  head_dim=64, intermediate=4096, seq=128, batch=16),
    "gemma-small": dict(vocab=1024, layers=2, hidden=128, heads=4, kv_heads=2,
                        head_dim=32, intermediate=1024, seq=64, batch=16),
    # The smoke test's: every configuration's code, the fewest FLOPs.
    "tiny": dict(vocab=256, layers=1, hidden=64, heads=4, kv_heads=2,
                 head_dim=16, intermediate=128, seq=16, batch=16),
}  # fmt: skip
SPEC = MODELS[MODEL]
GET_LAYOUT_MAP = keras_hub.models.GemmaBackbone.get_layout_map


def make_strategy():
    return {
        "one_device": lambda: kd.OneDeviceStrategy(kd.MirroredStrategy().devices[0]),
        "mirrored_8x1": lambda: kd.MirroredStrategy(),
        "fsdp_8x1": lambda: kd.MirroredStrategy(shard_variables=True),
        "auto_4x2": lambda: kd.MirroredStrategy(model_parallel=2),
        "auto_2x4": lambda: kd.MirroredStrategy(model_parallel=4),
        "auto_1x8": lambda: kd.MirroredStrategy(model_parallel=8),
        "hub_2x4": lambda: kd.MirroredStrategy(
            model_parallel=4, layout_map=GET_LAYOUT_MAP
        ),
        "auto_2x4_fsdp": lambda: kd.MirroredStrategy(
            model_parallel=4, shard_variables=True
        ),
    }[CONFIG]()


def make_model():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=SPEC["vocab"],
        num_layers=SPEC["layers"],
        num_query_heads=SPEC["heads"],
        num_key_value_heads=SPEC["kv_heads"],
        hidden_dim=SPEC["hidden"],
        intermediate_dim=SPEC["intermediate"],
        head_dim=SPEC["head_dim"],
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.RandomState(1)  # The same weights in every process.
    for v in model.weights:
        if len(v.shape) >= 2:
            v.assign(rng.normal(0, 0.02, v.shape).astype("float32"))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_data():
    rng = np.random.RandomState(0)
    n, seq = STEPS * SPEC["batch"], SPEC["seq"]
    tokens = rng.randint(1, SPEC["vocab"], size=(n, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), bool)}
    return x, tokens[:, 1:]


def main():
    strategy = make_strategy()
    with strategy.scope():
        model = make_model()
    x, y = make_data()
    timer, report = EpochTimer(), kd.utils.ScalingReport(print_summary=False)
    history = model.fit(
        x,
        y,
        batch_size=SPEC["batch"],
        epochs=1 + REPEATS,
        shuffle=False,
        verbose=0,
        callbacks=[timer, report],
    )
    memory = strategy.memory_report(model)
    largest = max(memory.variables, key=lambda v: v.nbytes)
    print(memory, file=sys.stderr)
    r = report.result
    print_result(
        {
            "config": CONFIG,
            "model": MODEL,
            "spec": SPEC,
            "mesh": dict(strategy.mesh.shape),
            "params": model.count_params(),
            "steps": STEPS,
            "first_epoch_s": timer.seconds[0],
            "ms_per_step": [s / STEPS * 1e3 for s in timer.seconds[1:]],
            "final_loss": float(history.history["loss"][-1]),
            "weight_bytes": memory.weight_bytes,
            "optimizer_bytes": memory.optimizer_bytes,
            "weight_bytes_per_device": memory.weight_bytes_per_device,
            "optimizer_bytes_per_device": memory.optimizer_bytes_per_device,
            "largest": [largest.path, largest.bytes_per_device, largest.nbytes],
            "model_flops_per_step": r["model_flops_per_step"],
            "collective_bytes": r["collective_bytes"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )


if __name__ == "__main__":
    main()
