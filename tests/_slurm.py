"""A real SLURM on this machine for the tests: munge, a controller and two
nodes (`node0`, `node1`), each node's `slurmd` in its own UTS and mount
namespace, so a task there has that hostname and an `/etc/hosts` where both
names resolve (to 127.0.0.1). Debian's packages (`slurmctld slurmd
slurm-client munge`), installed by `.ci/run`, never at test time.

Everything lives in one temporary folder (the configuration, munge's key and
socket, the controller's state, each node's spool and log); the daemons are
started by pid and killed by pid. Client commands find it through
`SLURM_CONF` (`Slurm.env`).
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

NODES = ("node0", "node1")
_DAEMONS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scontrol",
    "scancel",
    "squeue",
    "sinfo",
    "unshare",
)


def unavailable() -> str | None:
    """Why a SLURM cannot be started here (None: it can)."""
    if os.geteuid() != 0:
        return "a SLURM of two nodes needs root (namespaces, slurmd)"
    missing = [name for name in _DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed: `apt-get install slurmctld "
            "slurmd slurm-client munge` (.ci/run does)"
        )
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Slurm:
    """A controller and two nodes of 8 CPUs each, in `root`."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}
        self._released: set[tuple] = set()  # (job, restarts) started early.

    @property
    def env(self) -> dict:
        """What a client command (srun, sbatch, scontrol) needs."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        root = self.root
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        controller, *node_ports = _free_ports(1 + len(NODES))
        hostname = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 "
            f"Port={port} CPUs=8 RealMemory=4000 State=UNKNOWN"
            for name, port in zip(NODES, node_ports, strict=True)
        )
        self.conf.write_text(
            f"""ClusterName=kdtest
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={controller}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=1
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        hosts = root / "hosts"
        hosts.write_text(
            pathlib.Path("/etc/hosts").read_text() + f"\n127.0.0.1 {' '.join(NODES)}\n"
        )
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={root}/munge/munge.socket",
                f"--key-file={key}",
                f"--log-file={root}/log/munged.log",
                f"--pid-file={root}/munge/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
            ],
        )
        self._wait_for(lambda: (root / "munge" / "munge.socket").exists(), timeout)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in NODES:
            os.makedirs(root / "spool" / name, exist_ok=True)
            script = (
                f"hostname {name} && mount --bind {hosts} /etc/hosts && "
                f"exec slurmd -D -N {name} -f {self.conf}"
            )
            self._spawn(
                name,
                [
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    script,
                ],
            )
        self._wait_for(self._nodes_idle, timeout)

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115
        self.processes[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _wait_for(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({process.returncode}) while SLURM "
                        f"started:\n{self.logs()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SLURM did not start within {timeout:g} s:\n{self.logs()}"
                )
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(name) == "idle" for name in NODES)

    def run(self, command: list[str], check: bool = True, timeout: float = 30, **kw):
        """A client command against this SLURM."""
        return subprocess.run(
            command,
            env={**os.environ, **self.env, **kw.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            **kw,
        )

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").iterdir()):
            text = path.read_text(errors="replace")[-3000:]
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Kills the daemons it started (by pid) and every job step's tasks
        with them (slurmd's session)."""
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)

    def job(self, job_id: str) -> dict:
        """`scontrol show job`'s fields of `job_id` (JobState, ExitCode,
        Restarts, Reason, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout: float) -> dict:
        """Waits for `job_id` to end (within `timeout` s); returns its fields.

        SLURM holds a requeued batch job for 120 s (its BeginTime); this
        starts it 5 s after instead (`scontrol update ... StartTime=now+5`),
        as the scheduler would 120 s later. (Not at once: a node refuses to
        start a job within the second its previous run's credential was
        revoked, "Job credential revoked", and the job fails.)"""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            state = fields.get("JobState")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return fields
            if state == "PENDING" and fields.get("Reason") == "BeginTime":
                requeue = (job_id, fields.get("Restarts"))
                if requeue not in self._released:  # Once per requeue.
                    self._released.add(requeue)
                    self.run(
                        ["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"],
                        check=False,
                    )
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise TimeoutError(
                    f"SLURM job {job_id} did not end within {timeout:g} s: "
                    f"{fields}\n{self.logs()}"
                )
            time.sleep(0.5)
