"""`TerminationConfig`: how a preemption is noticed, saved and exited."""

import dataclasses
import sys
from collections.abc import Callable

__all__ = ["RESTART_CODE", "TerminationConfig"]

RESTART_CODE = 42  # tf's default exit code outside Google's platforms.


def _exit_for_restart() -> None:
    sys.exit(RESTART_CODE)


@dataclasses.dataclass(frozen=True)
class TerminationConfig:
    """Customizes `kd.PreemptionCheckpointHandler`, as tf's `TerminationConfig`.

    Example:

    ```python
    config = kd.TerminationConfig(exit_fn=lambda: sys.exit(3), grace_period=30)
    handler = kd.PreemptionCheckpointHandler(None, model, "ckpt", config)
    ```

    Args:
        termination_watcher_fn: a cheap, non-blocking function returning
            True once a termination notice is available; called after every
            `run`. Defaults to `None`: SIGTERM is the notice. With several
            processes a process whose watcher fires sends itself SIGTERM, so
            JAX's preemption service tells the others.
        exit_fn: called after the checkpoint is saved. Defaults to
            `sys.exit(42)` (tf's default code; rerun the same command to
            resume).
        grace_period: seconds between the notice and the actual termination.
            With a value, the handler saves at once (measuring the save),
            keeps training for as many runs as fit in the rest of the period,
            saves again and exits; every process stops at the same run.
            Defaults to `None`: save and exit at once.
        save_fn: called with no arguments right after the handler's own
            checkpoint (e.g. to save an input position the model does not
            hold). Defaults to `None`.

    Raises:
        TypeError: if a function is not callable.
        ValueError: for a negative or non-numeric `grace_period`.
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], None] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"`{name}` must be a function or None. Received: {name}={value!r}."
                )
        grace = self.grace_period
        if grace is not None and (
            isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0
        ):
            raise ValueError(
                "`grace_period` must be a number of seconds >= 0 or None. "
                f"Received: grace_period={grace!r}."
            )

    def exit(self) -> None:
        """Runs `exit_fn` (default: `sys.exit(42)`)."""
        (self.exit_fn or _exit_for_restart)()
