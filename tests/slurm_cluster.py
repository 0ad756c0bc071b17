"""A real one-node Slurm cluster for the tests (Debian's slurmctld + slurmd, installed by .ci/run):
started in a temporary directory on free ports, no munge (auth/none), stopped at the end. ``sbatch``,
``srun``, ``scancel`` and ``scontrol`` then behave as on a cluster: tasks get Slurm's variables,
``--signal`` and ``--requeue`` are Slurm's own."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from mmpipe.bench.common import free_port

NEEDED = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")


def missing() -> str:
    """Why no cluster can start here ('' when one can)."""
    absent = [b for b in NEEDED if shutil.which(b) is None]
    if absent:
        return f"no {', '.join(absent)} (apt-get install slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "slurmd runs tasks as their user only as root"
    return ""


class SlurmCluster:
    def __init__(self, root: str, cpus: int = 2):
        self.root = root
        host = socket.gethostname().split(".")[0]
        for d in ("state", "spool"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as fh:
            fh.write("\n".join([
                "ClusterName=mmpipetest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
                "AuthType=auth/none", "CredType=cred/none", f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
                "SwitchType=switch/none", "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "KillWait=10",
                f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
                "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4", ""]))
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-c"], env=self.env, check=True, capture_output=True, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout
            if out.strip() in ("idle", "mix", "alloc"):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the test Slurm cluster did not come up (sinfo: {out.strip()!r}); see {root}/*.log")

    def run(self, *cmd, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True, **kw)

    def job_state(self, job: str) -> dict:
        out = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld"):
            pid_file = os.path.join(self.root, f"{name}.pid")
            try:
                os.kill(int(open(pid_file).read().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
