"""Goodput: the share of a job's wall time that trained the model, across restarts.

The launcher keeps, for each start of the processes (an attempt), when it
started and ended them and process 0's last heartbeat, whose ledger
(`keras_dist/cluster/_heartbeat.py`) says the step the attempt resumed from,
when its first and last training steps were seen, and the seconds since the
first that the training thread waited for input, blocked in checkpoint
saves and spent in `evaluate`/`predict`. `account` splits the wall time,
from the first start to the last end, into:

- **productive**: training steps whose work the final model keeps;
- **start-up and compilation**: the first attempt's time before its first
  step (starting Python, joining, building, restoring, compiling);
- **input waits**, **checkpoint blocks**, **evaluation**;
- **failures**: the work a failure lost (the steps after the backup the
  next attempt resumed from, at that attempt's time per step), the time
  from the last step to the processes' end (detection, stopping), and every
  later attempt's start-up (time to resume);
- **other**: the successful end (the last saves, the processes exiting).

`goodput = productive / wall`. The times are read to a quarter second (the
heartbeat's interval); nothing is asked of the processes to measure them.
"""

import dataclasses

__all__ = ["Attempt", "account", "table"]

BUCKETS = {
    "productive": "productive steps",
    "startup": "start-up and compilation",
    "input": "input waits",
    "checkpoint": "checkpoint blocks",
    "evaluation": "evaluation (evaluate, predict, validation)",
    "failures": "failures: work lost and time to resume",
    "other": "other (the end: last saves, exiting)",
}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of the processes: launcher clock times, and process 0's
    last heartbeat (None: it sent none)."""

    started: float
    ended: float
    beat: dict | None
    failed: bool


def _trained(attempt: Attempt) -> bool:
    return bool(attempt.beat) and attempt.beat.get("first_step_at") is not None  # type: ignore[union-attr]


def account(attempts: list[Attempt]) -> dict:
    """Where the wall time of `attempts` went (seconds), and the goodput."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    lost_steps = 0
    rows = []
    for i, attempt in enumerate(attempts):
        later = next((a for a in attempts[i + 1 :] if _trained(a)), None)
        if i + 1 < len(attempts):  # Launcher time between two attempts.
            seconds["failures"] += max(0.0, attempts[i + 1].started - attempt.ended)
        if not _trained(attempt):
            bucket = "startup" if i == 0 and not attempt.failed else "failures"
            seconds[bucket] += attempt.ended - attempt.started
            rows.append({"failed": attempt.failed, "steps": 0, "lost_steps": 0})
            continue
        beat = attempt.beat or {}
        first, last = beat["first_step_at"], beat["last_step_at"]
        waits = {k: float(v) for k, v in beat.get("seconds", {}).items()}
        among = {k: float(v) for k, v in beat.get("seconds_at_last_step", {}).items()}
        # Among the steps, and after the last one (the end's saves, its
        # validation): each in its bucket, the rest of each span apart.
        raw = max(0.0, (last - first) - sum(among.values()))
        after = sum(waits.values()) - sum(among.values())
        steps = max(0, int(beat["step"]) - int(beat.get("restored", 0)))
        lost = 0
        if attempt.failed:
            # The next attempt resumed from its backup: the steps after it
            # are done again (all of this attempt's, if none trained after).
            resumed = int(((later.beat or {}) if later else beat).get("restored", 0))
            lost = min(steps, max(0, int(beat["step"]) - resumed))
        lost_time = raw * lost / steps if steps else 0.0
        startup = max(0.0, first - attempt.started)
        seconds["startup" if i == 0 else "failures"] += startup
        seconds["productive"] += raw - lost_time
        seconds["failures"] += lost_time
        for key, value in waits.items():
            seconds[key] += value
        tail = max(0.0, attempt.ended - last - after)
        seconds["failures" if attempt.failed else "other"] += tail
        lost_steps += lost
        rows.append({"failed": attempt.failed, "steps": steps, "lost_steps": lost})
    wall = attempts[-1].ended - attempts[0].started if attempts else 0.0
    return {
        "wall_s": round(wall, 3),
        "goodput": round(seconds["productive"] / wall, 4) if wall > 0 else None,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "restarts": len(attempts) - 1,
        "lost_steps": lost_steps,
        "attempts": rows,
    }


def table(result: dict) -> str:
    """`account`'s result as the launcher prints it."""
    wall = result["wall_s"] or 1.0
    restarts = result["restarts"]
    # The headline's share is the productive row's, rounded once (the JSON's
    # `goodput`, rounded on its own, could print 0.1 apart).
    productive = 100 * result["seconds"]["productive"] / wall
    head = (
        f"keras-dist-run: goodput {productive:.1f}% of "
        f"{result['wall_s']:.1f} s ({restarts} restart{'s' * (restarts != 1)}, "
        f"{result['lost_steps']} steps lost)"
    )
    lines = [head, "| where the time went | seconds | share |", "|---|---:|---:|"]
    for key, label in BUCKETS.items():
        value = result["seconds"][key]
        lines.append(f"| {label} | {value:.1f} | {100 * value / wall:.1f}% |")
    return "\n".join(lines)
