"""`keras-dist-run --max-restarts`: a job that loses a process finishes by itself.

Real 2-process clusters (one device a process, as most GPU clusters run)
training `_workload.backup_run` (3 epochs of 7 steps, a backup every 3
steps); a fault injected once at global step 11 (`_workload._KillAt`): a
SIGKILL of the chief or a worker, a SIGSTOP, a loop that stops making
steps, or a ValueError raised every time. The launcher names the process
and the cause in its last line, restarts the group, and the run ends with
the weights of an uninterrupted one-device run (the exact resume itself is
`BackupAndRestore`'s, tested bit for bit in `test_faults.py` and
`test_kill_trials.py`).
"""

import json
import re

import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close
from tests._processes import CLUSTER as HERE
from tests._processes import launch
from tests.cluster import _workload

pytestmark = [pytest.mark.slow, pytest.mark.processes]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    backup = tmp_path_factory.mktemp("reference") / "backup"
    return _workload.backup_run(kd.OneDeviceStrategy("cpu:0"), str(backup))


def _faulty_run(tmp_path, rank: int, how: str, *flags: str):
    env = {"KD_KILL_RANK": str(rank), "KD_KILL_AT": "11", "KD_FAULT": how}
    return launch(HERE / "fault_script.py", tmp_path, devices=1, env=env, flags=flags)


def _assert_restarted_and_exact(result, tmp_path, reference, cause: str) -> None:
    """One restart, announced after the first run's output, resumed from the
    backup of step 9 (epoch 2, step 3), ending with the reference weights."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    line = re.search(
        rf"keras-dist-run: {cause}; restarting all 2 \(restart 1 of 2\)\.\n",
        result.stderr,
    )
    assert line, result.stderr[-4000:]
    # The cause is the last word of the first run: no survivor's traceback after it.
    assert result.stderr.rfind("Traceback") < line.start()
    assert "[0] BackupAndRestore: resuming at epoch 2, step 3" in result.stdout
    for r in (0, 1):
        weights = json.loads((tmp_path / f"weights_{r}.json").read_text())
        assert_weights_close(reference, weights)


# The chief killed: the worker survives and waits in a collective. A killed
# worker (the chief survives) is named, stops the group and resumes exactly
# in test_faults.py's first test; the launcher's restart does not depend on
# the rank it lost.
@pytest.mark.parametrize("rank", [0], ids=["chief"])
def test_a_killed_process_is_restarted_and_the_run_finishes_exactly(
    tmp_path, reference, rank
):
    goodput = tmp_path / "goodput.json"
    result = _faulty_run(
        tmp_path, rank, "kill", "--max-restarts", "2", "--goodput", str(goodput)
    )
    # The step is the killed process's last heartbeat (four times a second).
    cause = rf"process {rank} was killed by SIGKILL at step \d+"
    _assert_restarted_and_exact(result, tmp_path, reference, cause)
    # Where the time went: every second in one bucket; the steps after the
    # backup of step 10 (epoch 2, step 3), up to the kill at 11, are redone
    # (the chief's last heartbeat may be a quarter second older).
    report = json.loads(goodput.read_text())
    seconds = report["seconds"]
    assert sum(seconds.values()) == pytest.approx(report["wall_s"], abs=0.01)
    assert report["restarts"] == 1 and report["lost_steps"] <= 2
    assert [row["failed"] for row in report["attempts"]] == [True, False]
    assert report["attempts"][1]["steps"] == 11  # Steps 11-21 after the resume.
    assert seconds["productive"] > 0 and seconds["startup"] > 0
    assert seconds["failures"] > 0 and seconds["checkpoint"] > 0
    assert report["goodput"] == pytest.approx(
        seconds["productive"] / report["wall_s"], abs=1e-3
    )
    # The table ends the run's output (after a restart it is printed anyway).
    assert "keras-dist-run: goodput " in result.stderr.splitlines()[-10]


def test_a_stopped_process_is_named_not_the_healthy_one(tmp_path, reference):
    # SIGSTOP: JAX's coordination service would abort process 0 after ~100 s
    # and the launcher would have blamed it. Its heartbeat names process 1.
    result = _faulty_run(
        tmp_path, 1, "stop", "--max-restarts", "2", "--heartbeat-timeout", "5"
    )
    # At the step the others wait in for it (its own last heartbeat may be
    # a second older).
    cause = (
        r"process 1 \([^)]+\) stopped answering at step 1[0-2] "
        r"\(no heartbeat for [5-9] s\)"
    )
    _assert_restarted_and_exact(result, tmp_path, reference, cause)
    assert "SIGABRT" not in result.stderr


def test_a_loop_that_stops_making_steps_is_a_hang(tmp_path, reference):
    # Process 1 sleeps inside a callback: its threads answer, no step runs
    # anywhere (process 0 waits for it in the next step's collective).
    result = _faulty_run(
        tmp_path, 1, "hang", "--max-restarts", "2", "--hang-timeout", "20"
    )
    cause = r"(process 1|no process) made no progress for 2\d s at step 1[01][^;]*"
    _assert_restarted_and_exact(result, tmp_path, reference, cause)


def test_the_same_exception_at_the_same_step_is_not_retried_again(tmp_path):
    result = _faulty_run(tmp_path, 1, "raise", "--max-restarts", "3")
    assert result.returncode == 1, result.stderr[-4000:]
    cause = (
        "process 1 failed at step 11 with ValueError: a bad batch at step 11 "
        "(" + str(HERE.parent / "cluster" / "_workload.py")
    )
    assert result.stderr.count(f"keras-dist-run: {cause}") == 4, result.stderr[-4000:]
    assert "restarting all 2 (restart 1 of 3)." in result.stderr
    assert "restart 2 of 3" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"keras-dist-run: {cause}")
    assert last.endswith(
        "as before the restart: a restart does not fix it; exiting with status 1."
    )


@pytest.mark.parametrize(
    "before, after",
    [((4, 1), (2, 1)), ((2, 2), (1, 2))],
    ids=["4x1-to-2x1", "2x2-to-1x2"],
)
def test_a_restart_on_half_the_processes_continues_the_same_run(
    tmp_path, reference, before, after
):
    # A host lost for good: the user restarts the same command on what is
    # left. The backup (of step 9) is resharded onto the smaller cluster,
    # which reads the same global batches from there. (4 x 1 is also the
    # suite's run of 4 processes of one device each: the resumed run ends at
    # one device's weights only if its 9 steps were one device's.)
    env = {"KD_KILL_RANK": "1", "KD_KILL_AT": "11"}
    first = launch(
        HERE / "fault_script.py", tmp_path, n=before[0], devices=before[1], env=env
    )
    assert first.returncode == 137, first.stderr[-3000:]
    second = launch(
        HERE / "fault_script.py", tmp_path, n=after[0], devices=after[1], env=env
    )
    assert second.returncode == 0, second.stderr[-3000:]
    replicas = before[0] * before[1]
    assert (
        f"[0] BackupAndRestore: resuming at epoch 2, step 3 (backup of {replicas} "
        "replicas)." in second.stdout
    )
    for r in range(after[0]):
        weights = json.loads((tmp_path / f"weights_{r}.json").read_text())
        assert_weights_close(reference, weights)


# The local tier (`BackupAndRestore(local_dir=..., local_save_freq=2)`,
# backups at each epoch's end): process 1 SIGKILLed at the end of step 12,
# once the local save of step 11 is on every process's storage. `wipe`: it
# deletes its own local tier first (a replaced host).
LOCAL_CASES = {
    # Every process restores its own parts of step 11: 1 step redone.
    "mirrored": ("2", "0", "the local tier's step 11, every process its own; "),
    # Its parts are gone; the state is replicated: process 0's, broadcast.
    "mirrored-wiped": ("2,wipe", "0", "the local tier's step 11, from process 0's; "),
    # FSDP: the variables are split over the processes and process 1's
    # parts are gone: the persistent tier's backup of epoch 1's end.
    "fsdp-wiped": ("2,wipe", "1", ""),
}


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_a_restart_resumes_from_the_local_tier(tmp_path, reference, case):
    local, shard, where = LOCAL_CASES[case]
    goodput = tmp_path / "goodput.json"
    env = {"KD_KILL_RANK": "1", "KD_KILL_AT": "12", "KD_LOCAL": local}
    env["KD_SHARD"] = shard
    result = launch(
        HERE / "fault_script.py",
        tmp_path,
        devices=1,
        env=env,
        flags=("--max-restarts", "2", "--goodput", str(goodput)),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "restarting all 2 (restart 1 of 2)." in result.stderr
    position = "epoch 2, step 0" if shard == "1" else "epoch 2, step 4"
    resumed = f"[0] BackupAndRestore: resuming at {position} ({where}backup of 2 "
    assert resumed + "replicas)." in result.stdout, result.stdout[-3000:]
    report = json.loads(goodput.read_text())
    # Work lost: the steps after the local save (11) up to the kill (12),
    # <= local_save_freq; after the persistent tier's (7): 5 (either may
    # count one more: process 0's last heartbeat may be a step ahead).
    assert report["lost_steps"] <= (6 if shard == "1" else 2), report
    for r in (0, 1):
        weights = json.loads((tmp_path / f"weights_{r}.json").read_text())
        assert_weights_close(reference, weights)
    # `delete_checkpoint`: each process deleted its own local tier at the end.
    assert not any((tmp_path / "local").glob("process_*/*")), list(
        (tmp_path / "local").rglob("*")
    )
