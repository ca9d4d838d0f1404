"""Data-parallel runs: one job as N ranks (PyTorch DDP), started by torchrun or by a submitit task
array.

Where the ranks come from (`from_env`): torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT; a hydra-submitit-launcher job with `tasks_per_node=N` runs N tasks whose rank
comes from submitit's JobEnvironment (SLURM_PROCID/SLURM_LOCALID on Slurm, SUBMITIT_LOCAL_* locally)
and whose rendezvous is the job's first host and a port derived from the job id. One rank
(WORLD_SIZE unset or 1) is the ordinary single-process job. The number of nodes (torchrun's
WORLD_SIZE / LOCAL_WORLD_SIZE, submitit's nodes) gives a sharded job's default device mesh: one
replica per node (`mesh_shape`, trainer.replicate=auto; HSDP in train/parallel.py).

The process group has the gloo backend for CPU tensors and, where an accelerator is available, its
default backend for its tensors (torch.distributed.get_default_backend_for_device:
"cpu:gloo,cuda:nccl" on CUDA); barriers and the CPU flags go through gloo (distributed_c10d.py
barrier: "cpu" is among the pairs). Each rank on a GPU uses cuda:LOCAL_RANK, one GPU per rank: NCCL
refuses two ranks on one GPU, so more ranks per node than visible GPUs is a config error
(`device_name`). torchrun's process group (made by train.py's `share_run_time` or `init`) lives as
long as the process, shared by the jobs of a sweep, and is destroyed once at its end, the same way
however its last job ended (`end_group`: a barrier on the store, then destroy); a 1-rank FSDP
job's own in-memory group is destroyed at the job's end (`init` returns True for it, `close`).
`Ranks` is what the loop sees: the rank, the world size, sums across ranks, a barrier; with one
rank every method is a no-op, so the single-process path is unchanged. Rank 0 alone writes the
records (summary.json, metrics.jsonl, checkpoints, W&B).

The output dir under torchrun: every rank runs Hydra, which names the dir from the clock;
`share_run_time()` (train.py, before Hydra starts) has rank 0's clock reading sent to every rank
through the process group's store and put in MIXPREC_RUN_TIME, which conf/config.yaml's
`hydra.run.dir`/`hydra.sweep.dir` use in place of `now`, so all ranks share one dir. Under the
submitit launcher the launcher names the dirs once, before the tasks start.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..config import ConfigError

RUN_TIME = "MIXPREC_RUN_TIME"
TIMEOUT = datetime.timedelta(minutes=10)
_MADE_HERE = False   # this process created the default process group (and so destroys it)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    nodes: int = 1   # the machines the ranks are spread over (1 when unknown)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (and return it)."""
        if self.active:
            tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
        return tensor

    def gather(self, obj) -> list:
        """Every rank's `obj` (what torch.save takes: tensors, numbers, containers), in rank order,
        on every rank: a collective that every rank must call. Sent as torch.save bytes:
        all_gather_object's own pickling of a CPU tensor fails to load on the receiver in torch 2.14
        ("UntypedStorage has no attribute dtype")."""
        if not self.active:
            return [obj]
        buf = io.BytesIO()
        torch.save(obj, buf)
        out = [None] * self.world
        tdist.all_gather_object(out, buf.getvalue())
        return [torch.load(io.BytesIO(b), weights_only=True) for b in out]

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        if not self.active:
            return flag
        return bool(self.sum_(torch.tensor([int(bool(flag))])).item())

    def agreed_stop(self, stop) -> "AgreedStop":
        """A stop() for the loop that every rank answers alike (AgreedStop)."""
        return AgreedStop(stop, self)


class AgreedStop:
    """A stop() for the loop that every rank answers alike: a signal seen by one rank (torchrun
    forwards SIGTERM to all, but not at the same step) stops all of them after the same step, and
    every rank answers with the same signal's name (the highest signal number any rank saw), so
    that every rank's job ends with the same status and exit code. One small all-reduce on the CPU
    per call under DDP (none with one rank). `last`: the latest answer."""

    def __init__(self, stop, ranks: Ranks):
        self.stop, self.ranks, self.last = stop, ranks, None

    def __call__(self) -> str | None:
        seen = self.stop()
        if self.ranks.active:
            number = torch.tensor([signal.Signals[seen].value if seen else 0])
            tdist.all_reduce(number, op=tdist.ReduceOp.MAX)
            seen = signal.Signals(int(number.item())).name if number.item() else None
        self.last = seen
        return seen


SINGLE = Ranks()


def from_env() -> Ranks:
    """This process's place in the job (torchrun's variables, else a submitit multi-task job, else
    one rank)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
                     nodes_of(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit   # lazy: optional (the SLURM launcher's), only under its executor

        env = submitit.JobEnvironment()
        if env.num_tasks > 1:
            os.environ.setdefault("MASTER_ADDR", env.hostnames[0])
            os.environ.setdefault(
                "MASTER_PORT",
                str(20000 + int("".join(filter(str.isdigit, env.job_id)) or 0) % 20000),
            )
            return Ranks(env.global_rank, env.num_tasks, env.local_rank,
                         nodes_of(env.num_tasks, env.num_tasks // max(env.num_nodes, 1)))
    return SINGLE


def nodes_of(world: int, per_node: int) -> int:
    """The number of nodes of `world` ranks with `per_node` on each (torchrun's WORLD_SIZE and
    LOCAL_WORLD_SIZE); 1 when that does not add up (nodes of different sizes: unknown)."""
    if per_node < 1 or world % per_node:
        return 1
    return world // per_node


def mesh_shape(replicate: int | str, ranks: Ranks) -> tuple[int, ...]:
    """The shape of a sharded job's device mesh (train/parallel.py): (world,) when it has one
    replica, the 1-D mesh of plain FSDP; else (replicas, ranks per replica), HSDP's 2-D mesh that
    shards within a replica and replicates across them. `replicate`: trainer.replicate (auto: one
    replica per node). ConfigError when the degree does not divide the world size."""
    degree = ranks.nodes if replicate == "auto" else replicate
    if ranks.world % degree:
        raise ConfigError(
            f"trainer.replicate={replicate}: {degree} replicas do not divide the {ranks.world} "
            f"rank(s) (each replica shards over world size / replicas ranks); use a divisor of "
            f"{ranks.world}, or trainer.replicate=auto (one replica per node)"
        )
    return (ranks.world,) if degree == 1 else (degree, ranks.world // degree)


def init(ranks: Ranks, sharded: bool = False) -> bool:
    """Join the job's process group (if it has several ranks, or is sharded: FSDP needs a group,
    one rank's own in-memory one outside torchrun, and none is joined yet); True when this call
    made it."""
    global _MADE_HERE
    if not (ranks.active or sharded):
        return False
    if not tdist.is_initialized():
        where = (dict(init_method="env://") if ranks.active
                 else dict(store=tdist.HashStore()))
        tdist.init_process_group(backend(), rank=ranks.rank, world_size=ranks.world,
                                 timeout=TIMEOUT, **where)
        if ranks.active:
            # torchrun's group lives as long as the process and is destroyed at its exit: the jobs
            # of a sweep (train.py -m under torchrun) share it. Made again for each job on the same
            # store, it met its predecessor's rendezvous keys and gloo's connect could hang.
            atexit.register(close_at_exit)
            return False
        _MADE_HERE = True
    return _MADE_HERE


def close_at_exit() -> None:
    """torchrun's group, at an exit that end_group did not see (an error of mixprec's own: no
    collective, a peer may be gone)."""
    if tdist.is_initialized():
        tdist.destroy_process_group()


def finish() -> None:
    """After the last job of a torchrun process ended well (train.py): end_group."""
    end_group(from_env())


END = "mixprec_end"


def attempt_key(name: str) -> str:
    """A key of the process group's store for this attempt of the job: torchrun's agent keeps its
    store across the restarts of --max-restarts, so each attempt counts its own arrivals and
    failures (TORCHELASTIC_RESTART_COUNT)."""
    return f"{name}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def end_group(ranks: Ranks, wait: bool = True, wait_s: float = 60.0) -> None:
    """The one way a torchrun process ends its process group, whatever ended its job (completed,
    interrupted, refused, failed): it arrives at a barrier on the group's store, waits there until
    every rank has arrived (every rank done with its collectives), then destroys the group. Without
    the barrier one rank tore its gloo pairs down while its peer was still finishing, and the peer
    died in gloo's threads ("terminate called without an active exception", SIGABRT), changing the
    job's exit code. `wait=False`: this rank's job failed first, while the others may wait for it
    in a collective: it arrives and goes (its peers' collective then ends in an error, or torchrun
    stops them). A store barrier, not a collective: a rank that is gone is waited for wait_s at
    most. One rank: nothing to do (a 1-rank FSDP job's own group: `close`). From here a SIGTERM is
    ignored: the job has ended, and torchrun, which stops every rank with SIGTERM once one has
    exited with an error, would turn the exit status of a rank still ending into -15 (SIGKILL,
    torchrun's next step, still ends a rank that hangs; Ctrl-C still acts)."""
    if not (ranks.active and tdist.is_initialized()):
        return
    with contextlib.suppress(ValueError):   # not the main thread: SIGTERM keeps its handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        store = tdist.distributed_c10d._get_default_store()
        key = attempt_key(END)
        store.add(key, 1)
        end = time.monotonic() + wait_s
        while wait and store.add(key, 0) < ranks.world and time.monotonic() < end:
            time.sleep(0.01)
    except Exception:   # the store went with the rank that held it, after every rank arrived  # noqa: BLE001
        pass
    if wait or not abort(None):
        tdist.destroy_process_group()


def backends(group) -> set[str]:
    """The backends of `group` (None: the default group) by name: a group made by backend() for a
    GPU job answers get_backend with one per device ("cpu:gloo,cuda:nccl"), a plain one with one
    name ("gloo")."""
    return {part.rpartition(":")[2] for part in str(tdist.get_backend(group)).split(",")}


def abort(group) -> bool:
    """Under NCCL, abort `group` (None: the default group) in place of destroying it, and say so
    (True): a graceful destroy of NCCL's communicators was a collective in some NCCL versions
    (torch's distributed_c10d says so), and a rank whose job failed first would wait in it for
    peers that wait for it in their own collective. Gloo, the CPU's backend, ends its pairs at
    once: False, and the caller destroys the group. Not yet run on NCCL (its tests need 2 GPUs)."""
    aborting = getattr(tdist.distributed_c10d, "_abort_process_group", None)
    if aborting is None or "nccl" not in backends(group):
        return False
    aborting(group)
    return True


FAILED = "mixprec_failed"


def first_failure(ranks: Ranks, line: str, store=None) -> tuple[int, str]:
    """This rank's job failed (`line`: its error): the first rank whose job failed and that rank's
    line, agreed through the process group's store, not a collective (a peer may be waiting for
    this rank in one). The first rank to call it records itself; a rank whose collective ended in
    an error because that rank left learns who failed first. One rank: (rank, line)."""
    if store is None:
        if not (ranks.active and tdist.is_initialized()):
            return ranks.rank, line
        store = tdist.distributed_c10d._get_default_store()
    try:
        first = store.compare_set(attempt_key(FAILED), "", f"{ranks.rank}:{line}").decode()
    except Exception:   # the store is gone with the rank that held it   # noqa: BLE001
        return ranks.rank, line
    rank, _, said = first.partition(":")
    return int(rank), said


def backend() -> str:
    """gloo for CPU tensors, plus the accelerator's default backend where one is visible
    ("cpu:gloo,cuda:nccl")."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return (
        "gloo"
        if acc is None
        else f"cpu:gloo,{acc.type}:{tdist.get_default_backend_for_device(acc)}"
    )


def backend_for(device: torch.device) -> str:
    """The backend that carries this job's tensors (gloo for a CPU job even where NCCL is in the
    group)."""
    return "gloo" if device.type == "cpu" else tdist.get_default_backend_for_device(device)


def close(made: bool) -> None:
    """Destroy the process group if this process made it (once: a second call finds none)."""
    global _MADE_HERE
    if made and _MADE_HERE and tdist.is_initialized():
        tdist.destroy_process_group()
        _MADE_HERE = False


def share_run_time() -> None:
    """Under torchrun, before Hydra: give every rank rank 0's clock reading as MIXPREC_RUN_TIME (see
    above)."""
    ranks = from_env()
    if not ranks.active or RUN_TIME in os.environ:
        return
    init(ranks)
    store = tdist.distributed_c10d._get_default_store()
    if ranks.main:
        store.set(RUN_TIME, time.strftime("%Y-%m-%d_%H-%M-%S"))
    os.environ[RUN_TIME] = store.get(RUN_TIME).decode()


def device_name(name: str, ranks: Ranks) -> str:
    """The device each rank uses: trainer.device auto or cuda -> cuda:LOCAL_RANK under DDP, one GPU
    per rank. Every rank of a node checks the node's rank count (torchrun's LOCAL_WORLD_SIZE, else
    this rank's index) against the visible GPUs, so all ranks fail alike with one config error
    instead of NCCL's "Multiple Ranks are using the same GPU" at DDP's first broadcast."""
    if not ranks.active:
        return name
    if name.startswith("cuda:"):
        raise ConfigError(
            f"trainer.device={name}: under DDP each rank uses cuda:LOCAL_RANK; use "
            "trainer.device=auto or cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)"
        )
    acc = torch.accelerator.current_accelerator(check_available=True)
    if name == "cpu" or acc is None or name not in ("auto", acc.type):
        return name
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.local_rank + 1))
    count = torch.accelerator.device_count()
    if per_node > count:
        raise ConfigError(
            f"{per_node} ranks on this node but {count} {acc.type} device(s) visible: NCCL takes "
            f"one GPU per rank; start at most {count} (torchrun --nproc_per_node={count}), or "
            "train on the CPU with trainer.device=cpu"
        )
    return f"{acc.type}:{ranks.local_rank}"


def check(batch_size: int, sync_bn: bool, device: torch.device, ranks: Ranks,
          ghost_splits: int = 1, sharded: bool = False, replicate: int | str = "auto") -> int:
    """The per-rank batch (the configured batch is the global one); ConfigError for what DDP or
    FSDP (sharded) cannot do. ghost_splits (trick.ghost_bn): ghost BN splits each rank's batch, so
    they must divide the per-rank batch (config.py checks the global one; this is before any work,
    where the layer would raise only in its first forward). replicate: trainer.replicate, whose
    degree must divide the world size (mesh_shape)."""
    if sharded and not tdist.is_available():
        raise ConfigError(
            "trainer.strategy=fsdp: this PyTorch build has no torch.distributed (FSDP2 shards "
            "through it); install a build with it, or use trainer.strategy=auto"
        )
    if sharded:
        mesh_shape(replicate, ranks)
    if batch_size % ranks.world:
        raise ConfigError(
            f"trainer.batch_size={batch_size}: the global batch must divide by the {ranks.world} "
            "ranks (each rank takes batch_size / world size)"
        )
    # SyncBatchNorm's kernels: CUDA (and a few others) only
    if sync_bn and ranks.active and device.type != "cuda":
        raise ConfigError(
            "trainer.sync_bn=true: SyncBatchNorm runs on GPUs only; on CPUs use sync_bn=false (or "
            "model.bn_eval=true for batch statistics that do not depend on the split)"
        )
    per_rank = batch_size // ranks.world
    if per_rank % ghost_splits:
        raise ConfigError(f"trick.ghost_splits={ghost_splits}: must divide each rank's batch, "
                          f"trainer.batch_size={batch_size} / {ranks.world} ranks = {per_rank} "
                          "(ghost BN splits each rank's batch); use a batch that divides by "
                          f"{ghost_splits * ranks.world}, or fewer splits")
    return per_rank


def mute_other_ranks() -> None:
    """Before Hydra starts (train.py): ranks other than 0 print nothing, so a bad override or config
    error is said once, by rank 0; `quiet_unless_main` gives them their stderr back when the job
    starts (for real crashes)."""
    if not from_env().main:
        sys.stdout = sys.stderr = open(os.devnull, "w")


SAID = "mixprec_error_said"


def error_said(ranks: Ranks, store=None, wait_s: float = 30.0) -> bool:
    """The error that ends a job is said once, by rank 0, but torchrun stops every rank as soon as
    one exits with an error: a rank other than 0 that failed first could have rank 0 stopped before
    it says its line. So rank 0 marks in the process group's store that it said it (True), and the
    other ranks wait for that mark, up to `wait_s` (True: rank 0 said it, or is gone; False: rank 0
    did not fail alike, and this rank's error is its own to say). Without a process group: True on
    rank 0, False elsewhere."""
    if store is None:
        if not (ranks.active and tdist.is_initialized()):
            return ranks.main
        store = tdist.distributed_c10d._get_default_store()
    try:
        if ranks.main:
            store.set(SAID, "1")
            return True
        end = time.monotonic() + wait_s
        while not store.check([SAID]):
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True
    except Exception:   # the store is gone with rank 0, which has ended the job   # noqa: BLE001
        return True


def quiet_unless_main(ranks: Ranks) -> None:
    """Ranks other than 0 print nothing to stdout (rank 0 speaks for the job); their stderr stays
    for real crashes."""
    if not ranks.main:
        sys.stdout, sys.stderr = open(os.devnull, "w"), sys.__stderr__


def spread(params, ranks: Ranks) -> float:
    """The largest difference of any weight between two ranks (0.0: every rank holds the same
    weights)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    high, low = flat.clone(), flat.clone()
    tdist.all_reduce(high, op=tdist.ReduceOp.MAX)
    tdist.all_reduce(low, op=tdist.ReduceOp.MIN)
    return (high - low).abs().max().item()


class Silent:
    """The records of a rank other than 0: nothing is written (rank 0 writes the job's records)."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def log(self, row: dict) -> None:
        pass

    def write_summary(self, summary: dict) -> None:
        pass

    def close(self) -> None:
        pass
