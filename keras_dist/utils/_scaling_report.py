"""`ScalingReport`: how fast a `fit` runs, and what holds it back."""

import statistics
import sys
import time

import jax
import keras

from keras_dist.data import _call
from keras_dist.strategies.state._memory_report import MemoryReport
from keras_dist.strategies.state._ownership import strategy_of_model
from keras_dist.training._step_cost import peak_flops, step_cost
from keras_dist.utils._step_breakdown import (
    Interval,
    Tally,
    breakdown_line,
    step_breakdown,
)

__all__ = ["ScalingReport"]


class ScalingReport(keras.callbacks.Callback):
    """Measures a `fit`: step time and where it goes, throughput, compile time.

    Add it to any `fit` (with or without a keras_dist strategy). It never
    blocks a step: Keras dispatches JAX steps asynchronously, so step times
    come from whole epochs (Keras waits for the results at each epoch end),
    minus validation; the first epoch, which compiles, is reported apart.
    With a keras_dist strategy it also reads the host time spent producing
    each batch (read, pad, lay out over the devices). keras_dist produces a
    batch on a background thread while the previous step runs, so input
    time close to the step time means the steps wait for their input: above
    `input_bound_fraction` of the step the summary calls the run
    input-bound.

    It also says where a step's time goes, per step of the same epochs:

    - **input**: host time the step loop waited for its batch (keras_dist
      input only: with a prefetch thread, only the part not hidden behind
      the previous step);
    - **dispatch**: host time inside the call of the compiled step: Keras's
      and keras_dist's Python around it and JAX's dispatch, which returns
      before the devices finish — or, once the devices are several steps
      behind, waits for them there (a device-bound run shows a long
      dispatch); with `steps_per_execution=N` fused into one program, one
      dispatch runs N steps;
    - **device**: the rest of the step's wall time: waiting for the devices
      (at the epoch's end, when Keras reads the results) and the rest of
      Keras's loop (callbacks).

    The three add up to the step time (the mean over the same epochs):
    `result["breakdown"]` holds each in ms per step (`input_ms`,
    `dispatch_ms`, `device_ms`, `step_ms`) and as a share of the step
    (`input_share`, ...); `result["dispatch_ms_per_step"]` and
    `result["device_ms_per_step"]` repeat two of them, and
    `result["dispatches"]`, `result["steps_per_dispatch"]` count the step
    programs called. Only clocks are read: no step is made to wait.

    With a keras_dist strategy it also reports where the model's state lives
    (`strategy.memory_report(model)`): bytes of weights and optimizer state
    per device and in all, host memory, and how many variables are split.

    And what a training step computes and sends, read from the program XLA
    compiled (`training/_step_cost.py`): the model's FLOPs per step
    (`result["model_flops_per_step"]`, from its cost analysis), the bytes
    of its collectives on a device per step (`result["collective_bytes"]`,
    by kind) and, given the devices' peak FLOP/s (`peak_flops`, or known
    for current TPUs and GPUs), the model FLOPs utilization
    (`result["mfu"]`).

    After `fit`, `report.result` holds the numbers (a dict); with
    `print_summary=True` the chief prints them as one screen.

    Example:

    ```python
    report = kd.utils.ScalingReport()
    model.fit(x, y, batch_size=256, epochs=3, callbacks=[report])
    report.result["ms_per_step"], report.result["examples_per_second"]
    report.result["breakdown"]  # {"step_ms": ..., "input_ms": ..., ...}
    ```

    Args:
        print_summary: print the summary at the end of `fit` (chief only).
        input_bound_fraction: input time / step time above which the run is
            called input-bound. Defaults to 0.8.
        peak_flops: one device's peak FLOP/s, for MFU. Defaults to None:
            the figure for the device kind (`PEAK_FLOPS`: TPU v2-v6e, Ironwood,
            H100/H200, A100, L4, A10G; none for CPUs).

    Raises:
        TypeError: if `input_bound_fraction` is not a number.
        ValueError: if `input_bound_fraction` is not in (0, 1].
    """

    def __init__(
        self,
        print_summary: bool = True,
        input_bound_fraction: float = 0.8,
        peak_flops: float | None = None,
    ):
        super().__init__()
        if peak_flops is not None and (
            isinstance(peak_flops, bool)
            or not isinstance(peak_flops, int | float)
            or peak_flops <= 0
        ):
            raise ValueError(
                "`peak_flops` must be a positive number of FLOP/s of one device "
                "(e.g. 197e12 for a TPU v5e chip). Received: "
                f"peak_flops={peak_flops!r}."
            )
        self.peak_flops = peak_flops
        if isinstance(input_bound_fraction, bool) or not isinstance(
            input_bound_fraction, int | float
        ):
            raise TypeError(
                "`input_bound_fraction` must be a number in (0, 1], e.g. 0.8. "
                f"Received: input_bound_fraction={input_bound_fraction!r} of type "
                f"{type(input_bound_fraction).__name__}."
            )
        if not 0 < input_bound_fraction <= 1:
            raise ValueError(
                "`input_bound_fraction` must be in (0, 1]. Received: "
                f"input_bound_fraction={input_bound_fraction!r}."
            )
        self.print_summary = print_summary
        self.input_bound_fraction = input_bound_fraction
        self.result: dict = {}

    # Measuring -------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._strategy = strategy_of_model(self.model)
        self._call = _call.active()  # The fit's: its input and step timings.
        self._epochs: list[Interval] = []
        self._warm: Interval | None = None  # Epoch 1 after its first step.
        self._first_step: float | None = None  # Seconds (compiling included).
        self._start = time.perf_counter()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_start = time.perf_counter()
        self._epoch_tally = self._tally()
        self._executions = 0  # Keras's loop: one per `steps_per_execution` steps.
        self._validation = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._executions == 1 and not self._epochs:
            self._first_step = time.perf_counter() - self._epoch_start  # Compiles.
            self._warm_tally = self._tally()
            self._first_steps = (self._warm_tally - self._epoch_tally).steps or 1
        self._executions += 1

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._test_start = time.perf_counter()

    def on_test_end(self, logs: dict | None = None) -> None:
        self._validation += time.perf_counter() - self._test_start

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Keras has waited for this epoch's results: the time is real.
        seconds = time.perf_counter() - self._epoch_start - self._validation
        tally = self._tally()
        interval = Interval(seconds, tally - self._epoch_tally, self._executions)
        if not self._epochs and self._first_step is not None:
            self._warm = Interval(
                seconds - self._first_step,
                tally - self._warm_tally,
                self._executions - 1,
            )
        self._epochs.append(interval)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.result = self._summarize(time.perf_counter() - self._start)
        if self.print_summary and jax.process_index() == 0:
            print(self.format(), file=sys.stdout, flush=True)

    def _tally(self) -> Tally:
        call = self._call
        if call is None:
            return Tally()
        steps, inputs = call.step_stats, call.input_stats
        return Tally(
            steps.steps, steps.dispatches, steps.seconds, inputs.taken, inputs.waited
        )

    # Reporting -------------------------------------------------------------

    def _summarize(self, total: float) -> dict:
        strategy = self._strategy
        call = self._call
        batch = call.batch_size if call is not None else None
        if batch is None:
            batch = self.params.get("batch_size") if self.params else None
        timed = [i for i in self._epochs[1:] if i.steps]
        if not timed and self._warm is not None and self._warm.steps:
            timed = [self._warm]
        steady = [i.seconds / i.steps for i in timed]
        step = statistics.median(steady) if steady else None
        compile_seconds = None
        if self._first_step is not None and step is not None:
            compile_seconds = max(0.0, self._first_step - step * self._first_steps)
        input_step = None
        if call is not None:
            input_step = call.input_stats.seconds_per_batch
        fraction = input_step / step if input_step is not None and step else None
        breakdown = step_breakdown(timed)
        everything = sum((i.tally for i in self._epochs), Tally())
        memory = None if strategy is None else strategy.memory_report(self.model)
        devices = 1 if strategy is None else len(strategy.devices)
        cost = None if call is None else step_cost(call.step_stats, devices)
        peak = self.peak_flops or peak_flops(jax.devices()[0])
        return {
            "strategy": repr(strategy) if strategy is not None else None,
            "replicas": strategy.num_replicas_in_sync if strategy is not None else 1,
            "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "global_batch": batch,
            "epochs": len(self._epochs),
            "steps": sum(i.steps for i in self._epochs),
            "ms_per_step": None if step is None else step * 1e3,
            "ms_per_step_epochs": [s * 1e3 for s in steady],
            "steps_per_second": None if not step else 1.0 / step,
            "examples_per_second": None if not step or not batch else batch / step,
            "compile_seconds": compile_seconds,
            "input_ms_per_step": None if input_step is None else input_step * 1e3,
            "input_fraction": fraction,
            "input_bound": bool(
                fraction is not None and fraction > self.input_bound_fraction
            ),
            "dispatch_ms_per_step": breakdown["dispatch_ms"] if breakdown else None,
            "device_ms_per_step": breakdown["device_ms"] if breakdown else None,
            "dispatches": everything.dispatches,
            "steps_per_dispatch": (
                everything.steps / everything.dispatches
                if everything.dispatches
                else None
            ),
            "breakdown": breakdown,
            "total_seconds": total,
            "memory": None if memory is None else _memory_summary(memory),
            "model_flops_per_step": None if cost is None else cost.flops,
            "collective_bytes": None if cost is None else cost.collective_bytes,
            "peak_flops": peak,
            "mfu": None
            if cost is None or not step or not peak
            else cost.mfu(step, peak),
        }

    def format(self) -> str:
        """The one-screen summary of `result`."""
        r = self.result

        def number(value: float | None, unit: str = "", digits: int = 2) -> str:
            return "n/a" if value is None else f"{value:.{digits}f}{unit}"

        lines = [
            "ScalingReport",
            f"  strategy        {r['strategy'] or 'none (plain Keras)'}",
            f"  devices         {r['devices']}, replicas {r['replicas']}",
            f"  global batch    {r['global_batch']}",
            f"  steps           {r['steps']} in {r['epochs']} epochs "
            f"({number(r['total_seconds'], ' s', 1)})",
            f"  step time       {number(r['ms_per_step'], ' ms')} "
            "(median over the epochs after the first)",
            f"  throughput      {number(r['steps_per_second'], ' steps/s', 1)}, "
            f"{number(r['examples_per_second'], ' examples/s', 0)}",
            f"  compile         {number(r['compile_seconds'], ' s')}",
            f"  input (host)    {number(r['input_ms_per_step'], ' ms/step')}"
            + (
                ""
                if r["input_fraction"] is None
                else f" = {r['input_fraction']:.0%} of the step"
            ),
        ]
        if r["breakdown"] is not None:
            lines.append(breakdown_line(r["breakdown"]))
        if r["steps_per_dispatch"] is not None:
            each = r["steps_per_dispatch"]
            lines.append(
                f"  dispatches      {r['dispatches']} ({each:g} "
                f"step{'' if each == 1 else 's'} each)"
            )
        if r["memory"] is not None:
            lines += _memory_lines(r["memory"])
        if r["model_flops_per_step"] is not None:
            sent = _bytes(sum(r["collective_bytes"].values()))
            gflop = r["model_flops_per_step"] / 1e9
            lines.append(
                f"  compute         {gflop:.3f} GFLOP per step; collectives "
                f"{sent} per device per step"
            )
            lines.append(
                "  MFU             "
                + (
                    f"{r['mfu']:.1%} of {r['peak_flops'] / 1e12:g} TFLOP/s per device"
                    if r["mfu"] is not None
                    else "n/a (peak FLOP/s unknown: ScalingReport(peak_flops=...))"
                )
            )
        if r["input_bound"]:
            lines.append(
                "  INPUT-BOUND: producing a batch takes "
                f"{r['input_fraction']:.0%} of the step. Feed device-ready "
                "batches: a tf.data pipeline with .prefetch(), larger batches, "
                "or PyDataset(workers=...)."
            )
        return "\n".join(lines)


def _memory_summary(report: MemoryReport) -> dict:
    return {
        "weight_bytes": report.weight_bytes,
        "weight_bytes_per_device": report.weight_bytes_per_device,
        "optimizer_bytes": report.optimizer_bytes,
        "optimizer_bytes_per_device": report.optimizer_bytes_per_device,
        "host_bytes_per_device": report.host_bytes_per_device,
        "variables": len(report.variables),
        "split_variables": sum(v.parts > 1 for v in report.variables),
    }


def _memory_lines(m: dict) -> list[str]:
    lines = [
        f"  weights         {_bytes(m['weight_bytes_per_device'])} per device "
        f"(of {_bytes(m['weight_bytes'])})",
        f"  optimizer state {_bytes(m['optimizer_bytes_per_device'])} per device "
        f"(of {_bytes(m['optimizer_bytes'])}); {m['split_variables']} of "
        f"{m['variables']} variables split over the devices",
    ]
    if m["host_bytes_per_device"]:
        lines.append(
            f"  host memory     {_bytes(m['host_bytes_per_device'])} of state per "
            "device kept in host memory"
        )
    lines.append("  (per variable: strategy.memory_report(model))")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
