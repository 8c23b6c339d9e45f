"""`InputStats`: host time spent producing each batch of a call, and waiting for it."""

import dataclasses

__all__ = ["InputStats"]


@dataclasses.dataclass
class InputStats:
    """Batches produced and host seconds spent on them (read, pad, shard).

    Filled by the `fit`/`evaluate`/`predict` input path of a strategy
    (`_pipeline.InputPass`, `_resident.ResidentPass`). Two clocks:

    - producing (`batches`, `seconds`): the work of making a batch, on
      whichever thread does it (a prefetch thread overlaps it with the
      steps); the first batch of each pass is kept apart (it includes
      starting the pass);
    - waiting (`taken`, `waited`): the time the step loop spent in `next()`
      for each batch it took, on its own thread: the input's share of the
      step time (`ScalingReport`'s breakdown).

    Attributes:
        batches: batches produced, after each pass's first.
        seconds: host seconds producing them.
        first_seconds: host seconds producing the first batch of each pass.
        taken: batches the step loop took (all of them).
        waited: host seconds the step loop waited for them.
    """

    batches: int = 0
    seconds: float = 0.0
    first_seconds: float = 0.0
    taken: int = 0
    waited: float = 0.0

    def record(self, seconds: float, first: bool, batches: int = 1) -> None:
        """`batches` batches were produced in `seconds` (a pass's first: apart)."""
        if first:
            self.first_seconds += seconds
        else:
            self.batches += batches
            self.seconds += seconds

    def record_wait(self, seconds: float, batches: int = 1) -> None:
        """The step loop waited `seconds` for its next `batches` batches."""
        self.taken += batches
        self.waited += seconds

    def reset(self) -> None:
        self.batches, self.seconds, self.first_seconds = 0, 0.0, 0.0
        self.taken, self.waited = 0, 0.0

    @property
    def seconds_per_batch(self) -> float | None:
        return self.seconds / self.batches if self.batches else None
