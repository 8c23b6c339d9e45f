"""`InputStats`: host time spent producing each batch of `fit`."""

import dataclasses

__all__ = ["InputStats"]


@dataclasses.dataclass
class InputStats:
    """Batches produced and host seconds spent on them (read, pad, shard).

    Filled by the `fit`/`evaluate`/`predict` input path of a strategy; the
    first batch of each pass is kept apart (it includes starting the pass).
    """

    batches: int = 0
    seconds: float = 0.0
    first_seconds: float = 0.0

    def record(self, seconds: float, first: bool) -> None:
        if first:
            self.first_seconds += seconds
        else:
            self.batches += 1
            self.seconds += seconds

    def reset(self) -> None:
        self.batches, self.seconds, self.first_seconds = 0, 0.0, 0.0

    @property
    def seconds_per_batch(self) -> float | None:
        return self.seconds / self.batches if self.batches else None
