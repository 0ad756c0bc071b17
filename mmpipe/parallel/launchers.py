"""Which launcher or job scheduler started this process, and its place in the world: the one place
that decides (``adopt``), before anything reads ``RANK``.

torch-style launchers (``deepspeed``, ``torchrun``, ``accelerate launch``, a PyTorchJob's operator)
export ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` themselves. Slurm's
``srun`` and MPI's ``mpirun`` export their own; they are translated here into torch's, so
``srun python launch/train.py`` and ``mpirun -np N python launch/train.py`` start as the others do:

| launcher | rank, world, local rank, local world | master address | master port |
|---|---|---|---|
| Slurm (``srun``) | ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (``SLURM_NTASKS``), ``SLURM_LOCALID``, the step's tasks on this node | 127.0.0.1 on one node, else the first host of ``SLURM_STEP_NODELIST`` (``SLURM_JOB_NODELIST``) | 10000 + ``SLURM_JOB_ID`` mod 20000 |
| Open MPI (``mpirun``) | ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE`` | 127.0.0.1 on one node, else Slurm's node list inside an allocation, else ``MASTER_ADDR`` is needed | 29500 |
| MPICH / Intel MPI (hydra) | ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS`` | as Open MPI | 29500 |
| Kubernetes without torchrun | ``PET_NODE_RANK``, ``PET_NNODES`` (one process a pod) | ``PET_MASTER_ADDR`` | ``PET_MASTER_PORT`` |

``MASTER_ADDR`` / ``MASTER_PORT`` already in the environment are kept (``mpirun -x MASTER_ADDR=...``).
Variables of two launchers that disagree about this process are one line (``ConfigError``): a
``RANK`` exported by hand under ``srun``, say. Rank 0 prints one line naming the launcher it
recognised. ``request_requeue``: a Slurm batch job stopped by ``SIGUSR1`` (``sbatch
--signal=USR1@T``) asks to run again (``scontrol requeue``)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from mmpipe.errors import ConfigError

MPI_DEFAULT_PORT = 29500  # torch's default, and DeepSpeed's mpi_discovery's
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000  # the port a Slurm job's ranks agree on without talking


@dataclass(frozen=True)
class Launch:
    """This process's place in the world, and who said so."""
    launcher: str  # deepspeed, torchrun, accelerate, slurm, openmpi, mpich, kubernetes, environment, python
    rank: int
    world: int
    local_rank: int
    local_world: int
    master: str  # host:port ("" for one process without a launcher: init_distributed picks a free port)
    detail: str = ""  # where the values came from

    def line(self) -> str:
        where = f", master {self.master}" if self.master else ""
        detail = f" ({self.detail})" if self.detail else ""
        return (f"[mmpipe] started by {self.launcher}{detail}: {self.world} rank{'s' if self.world != 1 else ''}, "
                f"{self.local_world} on this node{where}")


def _int(env, key: str, where: str) -> int:
    raw = env.get(key)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={raw!r} ({where}) is not a number: the launcher's variables are damaged; start "
                          "the ranks with the launcher itself") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-08,11],cpu1`` -> ``gpu07``, ``r[1-2]-n[01-04]`` -> ``r1-n01``."""
    item = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item)


def host_count(nodelist: str) -> int:
    """How many hosts a Slurm host list names."""
    n = 0
    for item in re.split(r",(?![^\[]*\])", nodelist.strip()):
        count = 1
        for group in re.findall(r"\[([^\]]*)\]", item):
            size = 0
            for part in group.split(","):
                lo, _, hi = part.partition("-")
                size += int(hi) - int(lo) + 1 if hi else 1
            count *= size
        n += count if item else 0
    return n


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """This node's share of Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2, 2, 2, 1)."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return 0
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else (counts[0] if len(set(counts)) == 1 else 0)


def _torch_launcher(env) -> str:
    if env.get("ACCELERATE_DYNAMO_BACKEND") is not None or env.get("ACCELERATE_MIXED_PRECISION") is not None:
        return "accelerate launch"
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return "torchrun"
    if env.get("CROSS_RANK") is not None and env.get("LOCAL_SIZE") is not None:
        return "deepspeed"
    if env.get("PET_NNODES") is not None:
        return "kubernetes"
    return "environment"


def _slurm(env) -> Optional[Launch]:
    """An ``srun`` task (a step's task: ``SLURM_STEP_ID`` set); ``None`` outside a step."""
    if env.get("SLURM_PROCID") is None or env.get("SLURM_STEP_ID") is None:
        return None
    rank = _int(env, "SLURM_PROCID", "Slurm")
    world = _int(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS", "Slurm")
    local = _int(env, "SLURM_LOCALID", "Slurm") if env.get("SLURM_LOCALID") else 0
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    node = int(env.get("SLURM_NODEID", "0") or 0)
    local_world = (int(env["SLURM_NTASKS_PER_NODE"]) if (env.get("SLURM_NTASKS_PER_NODE") or "").isdigit() else
                   tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "", node))
    one_node = not nodes or host_count(nodes) == 1
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_node else first_host(nodes))
    job = env.get("SLURM_JOB_ID", "0")
    port = env.get("MASTER_PORT") or str(SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN if job.isdigit() else
                                         MPI_DEFAULT_PORT)
    detail = f"job {job}, step {env.get('SLURM_STEP_ID')}"
    return Launch("slurm", rank, world, local, local_world or (world if one_node else 1), f"{addr}:{port}", detail)


def _mpi(env) -> Optional[Launch]:
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        name, keys = "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif env.get("PMI_RANK") is not None and env.get("PMI_SIZE") is not None:
        name, keys = "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    else:
        return None
    rank, world = _int(env, keys[0], name), _int(env, keys[1], name)
    local = _int(env, keys[2], name) if env.get(keys[2]) else (rank if env.get(keys[3]) == str(world) else 0)
    local_world = _int(env, keys[3], name) if env.get(keys[3]) else 1
    addr = env.get("MASTER_ADDR")
    if not addr:
        if local_world == world:
            addr = "127.0.0.1"
        elif env.get("SLURM_JOB_NODELIST"):  # mpirun inside a Slurm allocation: rank 0 on its first node
            addr = first_host(env["SLURM_JOB_NODELIST"])
        else:
            raise ConfigError(f"{name}: {world} ranks on more than one node and no MASTER_ADDR: export the first "
                              "host's address to every rank (mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500 ...)")
    port = env.get("MASTER_PORT") or str(MPI_DEFAULT_PORT)
    return Launch(name, rank, world, local, local_world, f"{addr}:{port}", f"{keys[0].rsplit('_', 1)[0]}_*")


def _kubernetes(env) -> Optional[Launch]:
    """A pod's own process, no torchrun: the PyTorchJob / TrainJob variables (``PET_*``) give the node."""
    if env.get("PET_NNODES") is None or env.get("PET_NODE_RANK") is None:
        return None
    per_pod = env.get("PET_NPROC_PER_NODE", "1")
    if per_pod not in ("1", "auto", ""):
        raise ConfigError(f"PET_NPROC_PER_NODE={per_pod}: the pod runs {per_pod} processes, and without torchrun only "
                          "one starts; make the container's command torchrun (it reads the PET_* variables), as "
                          "launch/k8s/pytorchjob.yaml does")
    world, rank = _int(env, "PET_NNODES", "kubernetes"), _int(env, "PET_NODE_RANK", "kubernetes")
    addr = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or "127.0.0.1"
    port = env.get("MASTER_PORT") or env.get("PET_MASTER_PORT") or str(MPI_DEFAULT_PORT)
    return Launch("kubernetes", rank, world, 0, 1, f"{addr}:{port}", "PET_NODE_RANK")


def _check_same(torch_rank: int, torch_world: int, other: Launch, launcher: str) -> None:
    if (torch_rank, torch_world) != (other.rank, other.world):
        raise ConfigError(f"RANK={torch_rank} / WORLD_SIZE={torch_world} in the environment disagree with "
                          f"{other.launcher}'s rank {other.rank} of {other.world} ({other.detail}), and no torch "
                          f"launcher set them ({launcher}): unset RANK and WORLD_SIZE (mmpipe reads "
                          f"{other.launcher}'s own variables), or start the ranks with torchrun")


def discover(env=None) -> Launch:
    """This process's place, from the variables of whichever launcher started it (see the module)."""
    env = os.environ if env is None else env
    slurm, mpi = _slurm(env), _mpi(env)
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        launcher = _torch_launcher(env)
        rank, world = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
        if launcher == "environment":  # set by hand or by a script: a scheduler's own count must agree
            for other in (mpi, slurm):
                if other is not None and other.world > 1:
                    _check_same(rank, world, other, launcher)
        local = int(env.get("LOCAL_RANK") or 0)
        local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 0) or world
        master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', MPI_DEFAULT_PORT)}"
        return Launch(launcher, rank, world, local, local_world, master)
    if slurm is None and env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") is not None and \
            int(env.get("SLURM_NTASKS") or 1) > 1 and mpi is None:
        raise ConfigError(f"started in Slurm job {env['SLURM_JOB_ID']}'s batch script, not by srun, with "
                          f"SLURM_NTASKS={env['SLURM_NTASKS']}: start one rank per task with srun (srun python "
                          "launch/train.py ...), as launch/slurm/train.sbatch does")
    if mpi is not None:
        if slurm is not None and slurm.world == mpi.world and slurm.rank != mpi.rank:
            raise ConfigError(f"{mpi.launcher}'s rank {mpi.rank} ({mpi.detail}) disagrees with Slurm's SLURM_PROCID="
                              f"{slurm.rank}: start the ranks with one of mpirun or srun")
        return mpi
    for found in (slurm, _kubernetes(env)):
        if found is not None:
            return found
    return Launch("python", 0, 1, 0, 1, "")


_ADOPTED: Optional[Launch] = None


def adopt(env=None) -> Launch:
    """Discover this process's place and export it as torch's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) where a scheduler gave it;
    rank 0 prints which launcher it recognised, once."""
    global _ADOPTED
    env = os.environ if env is None else env
    found = discover(env)
    if found.launcher in ("slurm", "openmpi", "mpich", "kubernetes"):
        addr, port = found.master.rsplit(":", 1)
        env.update(RANK=str(found.rank), WORLD_SIZE=str(found.world), LOCAL_RANK=str(found.local_rank),
                   LOCAL_WORLD_SIZE=str(found.local_world), MASTER_ADDR=addr, MASTER_PORT=port)
    if found.rank == 0 and found.launcher != "python" and found != _ADOPTED:
        print(found.line(), flush=True)
    _ADOPTED = found
    return found


def device_index(local_rank: int, count: int) -> int:
    """The accelerator this rank binds: its local rank, or the only one it sees (Slurm's
    ``--gpus-per-task=1`` shows each task one device)."""
    if count == 1 or local_rank < count:
        return 0 if count == 1 else local_rank
    raise ConfigError(f"LOCAL_RANK={local_rank} but this process sees {count} devices: start as many ranks per node "
                      "as it has devices (srun --ntasks-per-node, torchrun --nproc_per_node), or give each task "
                      "its own (srun --gpus-per-task=1)")


# --------------------------------------------------------------------------------------------
# Slurm: a stopped job asks to run again
# --------------------------------------------------------------------------------------------
def slurm_job(env=None) -> str:
    """The Slurm job this process runs in (an array task as ARRAYJOB_TASK), '' outside Slurm."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID", "")


def request_requeue(job: str) -> tuple[bool, str]:
    """``scontrol requeue JOB``: (done, what to log). Slurm then ends this job's processes and runs
    the batch script again; a job submitted with ``--no-requeue`` (or not by sbatch) is refused."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, f"Slurm job {job} was not requeued: no scontrol on PATH"
    proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return True, f"requeued Slurm job {job} (scontrol requeue): Slurm runs its batch script again"
    why = (proc.stderr or proc.stdout).strip().splitlines()
    return False, (f"Slurm job {job} was not requeued (scontrol requeue: {why[0] if why else proc.returncode}; "
                   "sbatch --requeue allows it)")
