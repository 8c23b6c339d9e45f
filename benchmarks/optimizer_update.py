"""Keras's Adam against optax's Adam: one update, fused in a loop, per device count.

B32 (keras_dist fit, 32 steps a dispatch) runs Keras's step; E32, the
hand-written limit, runs optax's Adam. Their programs are op for op alike,
yet E32 is faster on CPU devices. This benchmark isolates the optimizer: a
`lax.scan` of 32 Adam updates of one weight of each `--shapes` shape (the
tiny model's kernel is 784x10), each from its own random gradient,
replicated on 1 and on 8 devices, as in the training benchmark. Four
updates:

    keras        keras.optimizers.Adam(1e-3).stateless_apply
    optax        optax.adam(1e-3)
    keras-form   Keras's formula written in jax.numpy:
                 p - m * alpha / (sqrt(v) + eps), alpha = lr sqrt(1-b2^t) / (1-b1^t)
    optax-form   optax's formula, Keras's constants:
                 p - lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)

Each device count runs in a fresh process (XLA_FLAGS must be set before JAX
starts); within it, `--repeats` rounds alternate the updates, 50 programs of
32 updates each a sample. Prints microseconds per update (median and min-max
over the rounds) and what LLVM vectorized (the vector values in the
update's optimized LLVM IR, and how many of its elementwise kernels have
any), and writes `results/optimizer_update.{json,md}`. `--xla-flags` adds
XLA flags to the measuring processes, to try XLA:CPU's options.

    python benchmarks/optimizer_update.py     # 1 and 8 devices; 784x10, 784x128
    python benchmarks/optimizer_update.py --devices 1,2,8 --shapes 784x10,784x16
    python benchmarks/optimizer_update.py --out /tmp/ynn \
        --xla-flags=--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE
"""

import argparse
import datetime
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from _runs import failure, machine

HERE = pathlib.Path(__file__).resolve().parent
UPDATES = ("keras", "optax", "keras-form", "optax-form")
STEPS, CALLS = 32, 50


def _measure(
    devices: int, shape: tuple, repeats: int, dump: str, xla_flags: str = ""
) -> dict:
    """In this (fresh) process: update -> microseconds per update, per round.

    XLA dumps the programs' optimized LLVM IR to `dump` (this process's
    first call sets the flags, `xla_flags` appended), from which
    `_vector_ops` counts what LLVM vectorized.
    """
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} "
        f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*adam_.* {xla_flags}"
    )
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np
    import optax
    from _limit import adam
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # Every program compiled here (a cached one would not be dumped).
    jax.config.update("jax_enable_compilation_cache", False)
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
    variables = [keras.Variable(np.zeros(shape, "float32"), name="kernel")]
    weights = [v.value for v in variables]
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-7

    def by_formula(optax_form):
        def update(state, grads):
            params, (count, ms, vs) = state
            t = (count + 1).astype("float32")
            ms = [m + (g - m) * (1 - b1) for m, g in zip(ms, grads, strict=True)]
            vs = [v + (g * g - v) * (1 - b2) for v, g in zip(vs, grads, strict=True)]
            c1, c2 = 1 - b1**t, 1 - b2**t
            if optax_form:
                params = [
                    p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)
                    for p, m, v in zip(params, ms, vs, strict=True)
                ]
            else:
                alpha = lr * jnp.sqrt(c2) / c1
                params = [
                    p - m * alpha / (jnp.sqrt(v) + eps)
                    for p, m, v in zip(params, ms, vs, strict=True)
                ]
            return params, (count + 1, ms, vs)

        zeros = [jnp.zeros_like(w) for w in weights]
        return update, (weights, (jnp.int32(0), zeros, zeros))

    def library(keras_adam):  # The hand-written limit's Adams (EK's, E's).
        init, apply = adam(keras, variables, keras_adam=keras_adam)

        def update(state, grads):
            params, opt = state
            return apply(grads, opt, params)

        return update, (weights, init(weights))

    cases = {
        "keras": library(keras_adam=True),
        "optax": library(keras_adam=False),
        "keras-form": by_formula(optax_form=False),
        "optax-form": by_formula(optax_form=True),
    }
    rng = np.random.default_rng(0)
    grads = jax.device_put(
        [rng.normal(0, 1e-2, (STEPS, *w.shape)).astype("float32") for w in weights],
        replicated,
    )
    programs, states, modules = {}, {}, {}
    for name, (update, state) in cases.items():

        def fused(state, grads, update=update):
            def body(state, step_grads):
                return update(state, step_grads), None

            return jax.lax.scan(body, state, grads)[0]

        size = "x".join(map(str, shape))
        fused.__name__ = modules[name] = f"adam_{name.replace('-', '_')}_{size}"
        programs[name] = jax.jit(fused)
        states[name] = jax.block_until_ready(
            programs[name](jax.device_put(state, replicated), grads)
        )
    rounds = {name: [] for name in cases}
    for _ in range(repeats):
        for name, program in programs.items():
            state = states[name]
            start = time.perf_counter()
            for _ in range(CALLS):
                state = program(state, grads)
            states[name] = jax.block_until_ready(state)
            seconds = time.perf_counter() - start
            rounds[name].append(seconds / (CALLS * STEPS) * 1e6)
    versions = {m.__name__: m.__version__ for m in (jax, keras, optax)}
    vector_ops = {name: _vector_ops(dump, module) for name, module in modules.items()}
    return {"rounds": rounds, "versions": versions, "vector_ops": vector_ops}


def _vector_ops(dump: str, module: str) -> tuple[int, int, int]:
    """What LLVM vectorized in `module`'s kernels (their optimized LLVM IR).

    Returns `(values, vectorized, kernels)`: the vector values (`<N x
    float>`) in all its kernels, and how many of its elementwise kernels
    (the fusions' `*_kernel_module`s) have any, of how many.
    """
    values, kernels = 0, []
    for path in pathlib.Path(dump).glob(f"*.jit_{module}.*ir-with-opt.ll"):
        count = path.read_text().count(" x float>")
        values += count
        if path.name.endswith("_kernel_module.ir-with-opt.ll"):
            kernels.append(count)
    return values, sum(1 for count in kernels if count), len(kernels)


def _shape(text: str) -> tuple:
    """`784x10` -> (784, 10), or exit naming the argument."""
    try:
        shape = tuple(int(v) for v in text.split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        sys.exit(f"--shapes takes sizes like 784x10. Received: {text!r}.")
    return shape


def _row(devices: int, shape: str, name: str, measured: dict) -> dict:
    samples = measured["rounds"][name]
    return {
        "devices": devices,
        "shape": shape,
        "vector_ops": measured["vector_ops"][name][0],
        "vector_kernels": measured["vector_ops"][name][1],
        "kernels": measured["vector_ops"][name][2],
        "update": name,
        "us_median": statistics.median(samples),
        "us_min": min(samples),
        "us_max": max(samples),
        "samples": samples,
    }


def markdown(payload: dict) -> str:
    out = [
        f"Measured {payload['date']} on {payload['machine']}, "
        + ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
        + ": "
        f"`{payload['command']}`. A sample is {CALLS} programs of {STEPS} "
        f"fused updates; median and min-max over {payload['repeats']} "
        "alternating rounds.",
        "",
        "| devices | shape | update | us/update (median) | min-max | / optax "
        "| vector values in its LLVM IR | kernels with any |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        base = next(
            x["us_median"]
            for x in payload["rows"]
            if (x["devices"], x["shape"], x["update"])
            == (r["devices"], r["shape"], "optax")
        )
        out.append(
            f"| {r['devices']} | {r['shape']} | {r['update']} | {r['us_median']:.1f} | "
            f"{r['us_min']:.1f}-{r['us_max']:.1f} | {r['us_median'] / base:.2f} | "
            f"{r['vector_ops']} | {r['vector_kernels']} of {r['kernels']} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="1,8", help="comma list of device counts")
    p.add_argument("--shapes", default="784x10,784x128", help="comma list")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--xla-flags",
        default="",
        help='more XLA flags for the measuring processes, e.g. "--xla_cpu_...=..."',
    )
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = args.shapes.split(",")
    sizes = {shape: _shape(shape) for shape in shapes}  # Checked before any run.
    if args.measure is not None:  # The fresh process of one device count.
        with tempfile.TemporaryDirectory() as dump:
            measured = {
                shape: _measure(
                    args.measure, sizes[shape], args.repeats, dump, args.xla_flags
                )
                for shape in shapes
            }
        print("ROUNDS " + json.dumps(measured))
        return {}
    start = datetime.datetime.now(datetime.UTC)
    rows = []
    for devices in [int(v) for v in args.devices.split(",")]:
        command = [sys.executable, __file__, "--measure", str(devices)]
        done = subprocess.run(
            [
                *command,
                *("--shapes", args.shapes, "--repeats", str(args.repeats)),
                f"--xla-flags={args.xla_flags}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            said = failure(done.stderr) or "(nothing)"
            sys.exit(f"The {devices}-device measurement failed: {said}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("ROUNDS "))
        measured = json.loads(line.removeprefix("ROUNDS "))
        rows += [
            _row(devices, shape, name, measured[shape])
            for shape in shapes
            for name in UPDATES
        ]
    payload = {
        "benchmark": "optimizer_update",
        "date": start.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine("cpu", max(r["devices"] for r in rows)),
        "versions": measured[shapes[0]]["versions"],
        "command": "python benchmarks/optimizer_update.py "
        + shlex.join(argv or sys.argv[1:]),
        "repeats": args.repeats,
        "xla_flags": args.xla_flags,
        "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_update.json").write_text(json.dumps(payload, indent=1))
    text = markdown(payload)
    (out / "optimizer_update.md").write_text(text)
    print(text)
    return payload


if __name__ == "__main__":
    main()
