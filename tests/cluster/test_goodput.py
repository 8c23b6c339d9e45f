"""The launcher's goodput account (`keras_dist_run/_goodput.py`) on ledgers
as processes write them: every second of the wall in one bucket, the work a
failure lost counted as failure, not as productive. Real runs:
`test_restarts.py` (`--goodput`) and `benchmarks/restarts.py`."""

import re

import pytest

from keras_dist_run._goodput import BUCKETS, Attempt, account, table


def _beat(step, restored, first, last, among=(0.0, 0.0, 0.0), total=None):
    keys = ("input", "checkpoint", "evaluation")
    return {
        "step": step,
        "restored": restored,
        "first_step_at": first,
        "last_step_at": last,
        "seconds_at_last_step": dict(zip(keys, among, strict=True)),
        "seconds": dict(zip(keys, total or among, strict=True)),
    }


def test_one_attempt_splits_its_wall_time():
    # Started at 0; first step seen at 10 s; 20 steps to 50 s, with 2 s of
    # input waits, 3 s of saves and 5 s of validation among them; the end's
    # save took 1 s more, and the processes exited at 53 s.
    beat = _beat(20, 0, 10.0, 50.0, (2.0, 3.0, 5.0), total=(2.0, 4.0, 5.0))
    result = account([Attempt(0.0, 53.0, beat, failed=False)])
    assert result["seconds"] == {
        "productive": 30.0,
        "startup": 10.0,
        "input": 2.0,
        "checkpoint": 4.0,
        "evaluation": 5.0,
        "failures": 0.0,
        "other": 2.0,
    }
    assert result["wall_s"] == 53.0 and result["goodput"] == round(30 / 53, 4)
    assert result["restarts"] == 0 and result["lost_steps"] == 0


def test_a_failure_counts_the_steps_redone_and_the_time_to_resume():
    # Attempt 1: steps 0 -> 12 from 10 s to 22 s (1 s a step), killed; the
    # launcher saw it end at 24 s and started again at 24.5 s. Attempt 2
    # resumed from the backup of step 9 (steps 10-12 are done again) and
    # made its first step at 32.5 s, the last (21) at 44.5 s, and ended at 45.
    first = Attempt(0.0, 24.0, _beat(12, 0, 10.0, 22.0), failed=True)
    second = Attempt(24.5, 45.0, _beat(21, 9, 32.5, 44.5), failed=False)
    result = account([first, second])
    seconds = result["seconds"]
    assert result["lost_steps"] == 3
    assert seconds["productive"] == pytest.approx(12 - 3 + 12)
    # Lost work 3 s, 2 s from the last step to the end, 0.5 s between the
    # attempts, 8 s of the second's start-up.
    assert seconds["failures"] == pytest.approx(3 + 2 + 0.5 + 8)
    assert seconds["startup"] == 10.0 and seconds["other"] == 0.5
    assert sum(seconds.values()) == pytest.approx(result["wall_s"])
    assert [row["lost_steps"] for row in result["attempts"]] == [3, 0]


def test_an_attempt_that_never_trained_is_lost_time():
    # The first start failed before any step (no heartbeat); the second ran.
    failed = Attempt(0.0, 6.0, None, failed=True)
    ran = Attempt(6.0, 30.0, _beat(21, 0, 14.0, 29.0), failed=False)
    result = account([failed, ran])
    assert result["seconds"]["failures"] == pytest.approx(6 + 8)
    assert result["seconds"]["productive"] == pytest.approx(15)
    assert sum(result["seconds"].values()) == pytest.approx(30)


def test_the_table_names_every_bucket_with_its_share():
    beat = _beat(20, 0, 10.0, 50.0, (2.0, 3.0, 5.0))
    text = table(account([Attempt(0.0, 50.0, beat, failed=False)]))
    lines = text.splitlines()
    assert (
        lines[0] == "keras-dist-run: goodput 60.0% of 50.0 s (0 restarts, 0 steps lost)"
    )
    assert len(lines) == 3 + len(BUCKETS)
    assert "| productive steps | 30.0 | 60.0% |" in lines
    assert "| start-up and compilation | 10.0 | 20.0% |" in lines


@pytest.mark.parametrize("productive", [3.7245, 3.725, 3.7255, 37.25, 0.05])
def test_the_headline_and_the_productive_row_give_one_share(productive):
    """Rounded once: the headline says what its row says (37.2% and 37.3%
    for one run before)."""
    wall = 10.0 if productive < 10 else 100.0
    result = {
        "wall_s": wall,
        "goodput": round(productive / wall, 4),
        "seconds": {key: 0.0 for key in BUCKETS} | {"productive": productive},
        "restarts": 0,
        "lost_steps": 0,
    }
    lines = table(result).splitlines()
    headline = re.search(r"goodput ([\d.]+)% of", lines[0])[1]
    row = next(line for line in lines if line.startswith("| productive steps"))
    assert row.endswith(f"| {headline}% |")
