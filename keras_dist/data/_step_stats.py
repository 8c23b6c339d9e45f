"""`StepStats`: host time spent calling a call's compiled steps."""

import dataclasses

__all__ = ["StepStats"]


@dataclasses.dataclass
class StepStats:
    """Steps run, programs dispatched for them, and the host time of the calls.

    Filled by the step seams (`_keras_compat/_input.py`) around each call of
    a step program: one step, or the N steps of a fused
    `steps_per_execution` group (`training/_fused_steps.py`). The time is
    the host's, in the call: Keras's step wrapper and JAX's dispatch, which
    returns before the devices finish (JAX runs asynchronously) — and, when
    the devices are behind by several steps, waits for them. Nothing waits
    for a result to measure it.

    Attributes:
        steps: steps run.
        dispatches: programs called for them (`steps` / N with fused groups).
        seconds: host seconds inside those calls.
    """

    steps: int = 0
    dispatches: int = 0
    seconds: float = 0.0

    def record(self, seconds: float, steps: int = 1) -> None:
        """One program of `steps` steps was called, for `seconds` of host time."""
        self.steps += steps
        self.dispatches += 1
        self.seconds += seconds
