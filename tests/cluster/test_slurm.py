"""keras_dist under a real SLURM (`tests/_slurm.py`: a controller and two
nodes, `node0` and `node1`, each with its own hostname): `srun` of the
multi-host example at 2 x 1 and 2 x 2 devices, two jobs on the same nodes
at once; the failures guide's batch script run by `sbatch` - a task
SIGKILLed, then one SIGSTOPped, requeued by the script and resumed exactly;
a task raising an exception, not requeued; the restart bound; a program
started in the batch script itself, told at once.

Where SLURM cannot run (not root, packages missing) the tests skip, saying
why; `.ci/run` installs the packages and sets KERAS_DIST_REQUIRE_SLURM=1,
which turns the skip into a failure.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

import keras_dist as kd
from tests import _slurm
from tests._helpers import assert_weights_close
from tests._processes import CLUSTER, launch
from tests._xla import xla_flags
from tests.cluster import _workload

pytestmark = [pytest.mark.slow, pytest.mark.processes]

ROOT = CLUSTER.parents[1]
EXAMPLE = ROOT / "examples" / "multi_worker_digits.py"
GUIDE = ROOT / "docs" / "guides" / "failures.md"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _slurm.unavailable()
    if why is not None:
        if os.environ.get("KERAS_DIST_REQUIRE_SLURM"):
            pytest.fail(f"KERAS_DIST_REQUIRE_SLURM is set, but {why}")
        pytest.skip(why)
    cluster = _slurm.Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _env(devices: int, **extra: str) -> dict:
    """A task's environment: this one's, less the tests' own cluster
    settings, with `devices` CPU devices and this Python's scripts first on
    PATH (the batch script says `python`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KD_", "XLA_", "KERAS_DIST_", "TF_CONFIG", "SLURM_"))
    }
    env.update(
        XLA_FLAGS=xla_flags(devices),
        PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}",
    )
    env.update(extra)
    return env


def _weights(path) -> dict:
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: (
                found.__setitem__(name, item[()])
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    return found


def test_srun_trains_the_example_as_the_launcher_does_two_jobs_at_once(slurm, tmp_path):
    """`srun -N2 -n2` of the multi-host example at 2 x 1 and at 2 x 2 devices,
    both at once on the same two nodes (each job its own coordinator port,
    derived from its job id), each equal to the launcher's run of 2 x 2 with
    the same global batch (64) and seed. (`--seed` calls Keras's
    `set_random_seed`, which imports TensorFlow where it is installed, with
    or without keras_dist; the example without it imports none:
    `test_docs.py`.)"""
    common = ["--epochs", "1", "--seed", "0"]
    reference = launch(
        EXAMPLE,
        *common,
        "--batch-per-replica",
        "16",
        "--workdir",
        tmp_path / "launcher",
        n=2,
        devices=2,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    jobs = {}
    for devices, per_replica in ((1, 32), (2, 16)):
        jobs[devices] = subprocess.Popen(
            [
                "srun",
                "-N2",
                "-n2",
                "--kill-on-bad-exit=0",
                "--wait=15",
                f"--job-name=kd-2x{devices}",
                sys.executable,
                str(EXAMPLE),
                *common,
                "--batch-per-replica",
                str(per_replica),
                "--workdir",
                str(tmp_path / f"2x{devices}"),
            ],
            env={**_env(devices), **slurm.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outputs = {d: p.communicate(timeout=400) for d, p in jobs.items()}
    expected = _weights(tmp_path / "launcher" / "checkpoints" / "ckpt_1.weights.h5")
    accuracy = re.findall(r"test accuracy (\S+);", reference.stdout)
    assert len(accuracy) == 2  # One line a process.
    ports, spans = {}, []
    for devices, (out, err) in outputs.items():
        assert jobs[devices].returncode == 0, out[-2000:] + err[-3000:]
        joined = re.findall(
            r"keras_dist: joining as process (\d) of 2 \(.*from SLURM\), "
            r"coordinator node0:(\d+)",
            err,
        )
        assert sorted(rank for rank, _ in joined) == ["0", "1"], err[-3000:]
        assert f"{devices} local / {2 * devices} global cpu devices" in err
        assert re.findall(r"test accuracy (\S+);", out) == accuracy
        got = _weights(tmp_path / f"2x{devices}" / "checkpoints" / "ckpt_1.weights.h5")
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
        listed = slurm.run(["squeue", "-h", "-t", "all", "-n", f"kd-2x{devices}"])
        job_id = int(listed.stdout.split()[0])
        ports[job_id] = int(joined[0][1])
        # srun returns while the job may still be COMPLETING, when SLURM's
        # NodeList holds only the nodes not yet released: wait for its end.
        fields = slurm.wait(str(job_id), timeout=60)
        assert fields["JobState"] == "COMPLETED", fields
        spans.append((fields["StartTime"], fields["EndTime"], fields["NodeList"]))
    (start_a, end_a, nodes_a), (start_b, end_b, nodes_b) = spans
    assert nodes_a == nodes_b == "node[0-1]"
    assert start_b < end_a and start_a < end_b  # At once.
    # Each job its own coordinator port, derived from its id as JAX does.
    assert ports == {job: 61440 + job % 4096 for job in ports}


def _batch_script() -> str:
    """The failures guide's SLURM batch script, as it prints it."""
    blocks = [
        textwrap.dedent(block)
        for indent, block in re.findall(
            r"^( *)```bash\n(.*?)^\1```", GUIDE.read_text(), flags=re.S | re.M
        )
        if block.lstrip().startswith("#!/bin/bash")
    ]
    assert len(blocks) == 1, blocks
    return blocks[0]


def _submit(slurm, tmp_path, env: dict, timeout: float = 600) -> tuple[dict, str]:
    """The guide's batch script on 2 nodes, `train.py` the fault workload
    (`fault_script.py`, one device a task): the job's end and output."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(
        "import runpy, sys\n"
        f"sys.argv = [{str(CLUSTER / 'fault_script.py')!r}, {str(work)!r}]\n"
        f"runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    (work / "job.sh").write_text(_batch_script())
    submitted = slurm.run(
        ["sbatch", "--parsable", f"--chdir={work}", str(work / "job.sh")],
        env=_env(1, **env),
    )
    job_id = submitted.stdout.strip().split(";")[0]
    fields = slurm.wait(job_id, timeout)
    return fields, (work / f"slurm-{job_id}.out").read_text(errors="replace")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    backup = tmp_path_factory.mktemp("reference") / "backup"
    return _workload.backup_run(kd.OneDeviceStrategy("cpu:0"), str(backup))


def test_the_guides_batch_script_requeues_a_killed_and_a_frozen_task_exactly(
    slurm, tmp_path, reference
):
    """Task 1 SIGKILLed at step 5: task 0 exits 75, srun 137, the script
    requeues the job; the rerun resumes, and task 1 SIGSTOPs itself at step
    11: task 0 names it from the heartbeat (process, host, step, seconds
    silent) and exits 75, srun's --wait ends task 1, the script requeues
    again; the third run finishes with the weights of an uninterrupted run."""
    fields, out = _submit(
        slurm,
        tmp_path,
        {
            "KD_KILL_RANK": "1",
            "KD_KILL_AT": "5,11",
            "KD_FAULT": "kill,stop",
            "KERAS_DIST_HEARTBEAT_TIMEOUT": "5",
        },
    )
    assert fields["JobState"] == "COMPLETED", out[-5000:]
    assert fields["Restarts"] == "2" and fields["ExitCode"] == "0:0"
    assert re.search(
        r"keras_dist: process 1 \(node1\) stopped answering at step 1[12] "
        r"\(no heartbeat for [5-7] s\); this process \(process 0\) exits 75",
        out,
    ), out[-5000:]
    assert "Terminating process" not in out  # JAX never aborted task 0.
    assert len(re.findall(r"BackupAndRestore: resuming at epoch", out)) == 2
    for rank in (0, 1):
        weights = json.loads((tmp_path / "work" / f"weights_{rank}.json").read_text())
        assert_weights_close(reference, weights)


def test_the_guides_batch_script_fails_a_bug_without_a_requeue(slurm, tmp_path):
    """Task 1 raises a ValueError at step 5: it exits 1, task 0, which lost
    it, exits 1 too; srun 1; the script does not requeue: the job FAILED
    with status 1, the exception's line in its output."""
    started = time.monotonic()
    fields, out = _submit(
        slurm,
        tmp_path,
        {"KD_KILL_RANK": "1", "KD_KILL_AT": "5", "KD_FAULT": "raise"},
    )
    assert fields["JobState"] == "FAILED", out[-5000:]
    assert fields["ExitCode"] == "1:0" and fields["Restarts"] == "0"
    assert "ValueError: a bad batch at step 5" in out
    assert "exited with exit code 1" in out.lower()
    assert time.monotonic() - started < 150


def test_the_guides_batch_script_bounds_the_restarts(slurm, tmp_path):
    """MAX_RESTARTS=1 and a task SIGKILLed at step 4 and again at step 8:
    one requeue, then the job fails with the killed task's status (137)."""
    fields, out = _submit(
        slurm,
        tmp_path,
        {"KD_KILL_RANK": "1", "KD_KILL_AT": "4,8", "MAX_RESTARTS": "1"},
    )
    assert fields["JobState"] == "FAILED", out[-5000:]
    assert fields["Restarts"] == "1" and fields["ExitCode"] == "137:0", fields


def test_a_program_in_the_batch_script_itself_is_told_at_once(slurm, tmp_path):
    """`python train.py` in the batch script, not under srun: SLURM_NTASKS
    says 2 but no step runs; keras_dist says so and how to start the tasks,
    instead of waiting for a peer that never comes."""
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        "python -c 'import keras_dist as kd; kd.MultiWorkerMirroredStrategy()'\n"
    )
    started = time.monotonic()
    job_id = slurm.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=_env(1)
    ).stdout.strip()
    fields = slurm.wait(job_id, 120)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "1:0", out
    assert (
        f"ClusterConfigError: This process runs in SLURM job {job_id}'s batch "
        "script, not as one of its 2 tasks (SLURM_STEP_ID is not set)"
    ) in out
    assert "`srun python train.py`" in out
    assert time.monotonic() - started < 60
