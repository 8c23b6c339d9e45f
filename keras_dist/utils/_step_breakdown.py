"""Where a step's time goes: input, dispatch, device (`ScalingReport`).

The step loop of `fit` runs on one host thread: it waits for a batch
(`InputStats.waited`), calls the step program (`StepStats.seconds`), and the
rest of the wall time is Keras's loop and the wait for the devices (JAX runs
asynchronously: Keras waits for the results at the epoch's end). The two
measured intervals never overlap and lie inside the step loop's wall time, so
the rest is never negative but for clock rounding.
"""

from typing import NamedTuple

__all__ = ["Interval", "Tally", "breakdown_line", "step_breakdown"]


class Tally(NamedTuple):
    """The counts of a call's step and input stats at one moment."""

    steps: int = 0
    dispatches: int = 0
    dispatch_seconds: float = 0.0
    input_batches: int = 0
    input_seconds: float = 0.0

    def __add__(self, other):
        return Tally(*(a + b for a, b in zip(self, other, strict=True)))

    def __sub__(self, other):
        return Tally(*(a - b for a, b in zip(self, other, strict=True)))


class Interval(NamedTuple):
    """Training time between two moments (validation left out) and its counts."""

    seconds: float
    tally: Tally
    executions: int  # Keras's loop iterations (the steps if none were counted).

    @property
    def steps(self) -> int:
        return self.tally.steps or self.executions


def step_breakdown(timed: list[Interval]) -> dict | None:
    """Where the time of the `timed` intervals went: ms per step and shares.

    Returns:
        `step_ms` (the mean wall time of a step), `input_ms`, `dispatch_ms`,
        `device_ms` (they add up to `step_ms`) and each part's share of the
        step (`input_share`, ...); the input parts are None when no input
        was timed (plain Keras input). None when no step was timed.
    """
    steps = sum(i.steps for i in timed)
    if not steps:
        return None
    wall = sum(i.seconds for i in timed)
    input_seconds = sum(i.tally.input_seconds for i in timed)
    dispatch_seconds = sum(i.tally.dispatch_seconds for i in timed)
    parts: dict[str, float | None] = {
        "input": input_seconds,
        "dispatch": dispatch_seconds,
        "device": max(0.0, wall - (input_seconds + dispatch_seconds)),
    }
    if not any(i.tally.input_batches for i in timed):
        parts["input"] = None
    breakdown: dict[str, float | None] = {"step_ms": wall / steps * 1e3}
    for name, seconds in parts.items():
        breakdown[f"{name}_ms"] = None if seconds is None else seconds / steps * 1e3
        breakdown[f"{name}_share"] = None if seconds is None else seconds / wall
    return breakdown


def breakdown_line(breakdown: dict) -> str:
    """`step time X ms = input a + dispatch b + device c ms/step (shares)`."""
    parts, shares = [], []
    for name in ("input", "dispatch", "device"):
        ms, share = breakdown[f"{name}_ms"], breakdown[f"{name}_share"]
        parts.append(f"{name} {'n/a' if ms is None else f'{ms:.2f}'}")
        shares.append("n/a" if share is None else f"{share:.0%}")
    return (
        f"  breakdown       step time {breakdown['step_ms']:.2f} ms = "
        f"{' + '.join(parts)} ms/step ({' / '.join(shares)})"
    )
