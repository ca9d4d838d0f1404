"""The trained model for several ranks: DDP replicas or FSDP2 shards.

DDP (`wrap`): under several ranks the model is wrapped in DistributedDataParallel (BatchNorm
synchronised if trainer.sync_bn); the process group and the ranks are runtime/dist.py's.

trainer.strategy=fsdp: the trained model sharded with FSDP2 (torch.distributed.fsdp.fully_shard).

Units, innermost first (each is all-gathered before its forward and freed after, its gradients
reduce-scattered after its backward): each GPT block, each ResNet stage (torchvision's
layer1..layer4), then the root, which holds the rest (embeddings and the tied head, the stem, the
classifier), the same in every precision mode. Each unit's MixedPrecisionPolicy is the precision
mode's (precision/fsdp.py); a BatchNorm that the mode keeps in fp32 stays in its unit and reads
its weights in fp32 (fsdp.fp32_affine), rather than being an fp32 unit of its own. The mesh
(runtime/dist.mesh_shape, from trainer.replicate) is one dimension over every rank of the job (a
1-rank job is FSDP's code path on one rank), or HSDP's two, ("replicate", "shard"): each parameter
is sharded over the ranks of a replica (a node, by default) and each replica holds all of it;
after backward FSDP reduce-scatters the gradients within a replica, then all-reduces the shards
across replicas. fully_shard turns the parameters into DTensor shards in place (placements
(Shard(0),), or (Replicate(), Shard(0)) under HSDP), so the optimizer must be built after it, on
them (train/build.py's order).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, PrecisionConfig
from ..runtime import dist
from ..models.gpt import GPT
from ..precision import fsdp
from .compile import compile_model

log = logging.getLogger(__name__)


def wrap(
    model: torch.nn.Module, device: torch.device, sync_bn: bool, ranks: dist.Ranks
) -> torch.nn.Module:
    """The model the training loop runs: DDP-wrapped (BatchNorm synchronised if asked) under several
    ranks. Gradients are averaged across ranks during backward, so the precision policy
    (GradScaler's unscale, the o2 copy into fp32 masters) sees the averaged gradients on every rank
    and every rank steps alike."""
    if not ranks.active:
        return model
    if sync_bn:
        plain = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
        special = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and type(m) not in plain
            }
        )
        if special:   # convert_sync_batchnorm would replace them with plain SyncBatchNorm, silently
            raise ConfigError(
                f"trainer.sync_bn=true: {', '.join(special)} would become plain SyncBatchNorm, "
                "losing its own statistics (ghost BN: per split of each rank's batch); use "
                "trainer.sync_bn=false"
            )
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])


def unit_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where the units are: (parent, name) of each GPT block, each ResNet stage."""
    if isinstance(model, GPT):
        return [(model.blocks, name) for name, _ in model.blocks.named_children()]
    return [(model, name) for name, _ in model.named_children() if name.startswith("layer")]


def units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules sharded as units of their own: the GPT's blocks, a ResNet's stages."""
    return [parent.get_submodule(name) for parent, name in unit_slots(model)]


def compile_units(model: nn.Module, cfg: PrecisionConfig, mode: str) -> None:
    """trainer.compile under FSDP: each unit through torch.compile, put in its place, before
    fully_shard (torchtitan's apply_compile, then apply_fsdp). FSDP's hooks are dynamo-disabled:
    compiled after fully_shard, the whole root broke its graph at every unit's hooks and dynamo's
    recompile limit left part of the model eager. A unit's wrapper carries FSDP's hooks outside
    its compiled frame; the root's own layers (embeddings and head, stem and classifier) run
    eagerly. A model without units is compiled whole, after fully_shard, as before
    (compile.compile_model). Parameter names gain the wrapper's `_orig_mod.`, which DCP's state
    dicts (checkpoints, the saved weights) leave out."""
    if mode == "none":
        return
    for parent, name in unit_slots(model):
        unit = parent.get_submodule(name)
        parent.register_module(
            name, compile_model(unit, mode, options=fsdp.compile_options(cfg)))


# the process groups the meshes of this process's jobs made (HSDP's replicate and shard groups),
# destroyed at the job's end (release_meshes): a torchrun sweep's jobs share one process
_MADE_GROUPS: list = []


def device_mesh(device: torch.device, shape: tuple[int, ...] | None = None) -> DeviceMesh:
    """The job's device mesh: 1-D over every rank (shape None or (world,)), or HSDP's 2-D
    (replicas, ranks per replica), its dimensions named "replicate" and "shard". The groups it
    makes besides the default one are destroyed at the job's end (release_meshes)."""
    if shape is None or len(shape) == 1:
        mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
    else:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    world = tdist.distributed_c10d._get_default_group()
    _MADE_GROUPS.extend(g for g in mesh.get_all_groups() if g is not world)
    return mesh


def release_meshes(failed: bool = False) -> None:
    """Destroy the process groups the job's meshes made (parts.built_parts, however the job
    ended): each job of a sweep makes its own, and NCCL's communicators hold GPU memory and
    connections for as long as they live. failed: the job raised, and a peer may wait in a
    collective on one of them: under NCCL they are aborted instead (dist.abort). The default group
    is left to runtime/dist.py."""
    while _MADE_GROUPS:
        group = _MADE_GROUPS.pop()
        if not (tdist.is_initialized() and group in tdist.distributed_c10d._world.pg_map):
            continue   # the default group's end took it along
        try:
            if not (failed and dist.abort(group)):
                tdist.destroy_process_group(group)
        except Exception as e:   # never in place of the error that ended the job
            log.warning(f"mixprec: note: FSDP's mesh group not destroyed at the job's end ({e})")


def mesh_record(shape: tuple[int, ...]) -> dict:
    """What summary.json says of a mesh shape: its replicas and the ranks each shards over."""
    return {"replicate": 1 if len(shape) == 1 else shape[0], "shard": shape[-1]}


def shard(model: nn.Module, cfg: PrecisionConfig, device: torch.device,
          shape: tuple[int, ...] | None = None, compile_mode: str = "none") -> nn.Module:
    """fully_shard `model` in place over the mesh of `shape` (runtime/dist.mesh_shape; None: 1-D
    over every rank; see above), its units compiled first in `compile_mode` (trainer.compile,
    compile_units); returns it. The BatchNorm layers that the mode keeps in fp32 read their
    weights in fp32 inside their units (fsdp.fp32_affine)."""
    for m in model.modules():
        if fsdp.keeps_fp32(cfg, m):
            fsdp.fp32_affine(m)
    compile_units(model, cfg, compile_mode)
    mesh = device_mesh(device, shape)
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=fsdp.mixed_precision(cfg))
    return fully_shard(model, mesh=mesh, mp_policy=fsdp.mixed_precision(cfg, root=True))


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (its shard of a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def held(t: torch.Tensor) -> int:
    """The bytes this rank holds of `t`: its shard of a DTensor; of a tensor subclass, its inner
    tensors (torchao's quantized optimizer states hold 1 or 0.5 byte codes and fp32 block scales,
    not numel() x element_size() of the fp32 tensor they stand for)."""
    t = local(t)
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(held(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The bytes of parameters, gradients (as they are now: none after zero_grad) and optimizer
    state that this rank holds: with N ranks per replica about 1/N of one process's (the local
    shard of a DTensor, whose replicate dimension, under HSDP, keeps a whole shard on each)."""
    params = {id(p): p for p in model.parameters()}.values()   # a tied weight once
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": sum(held(p) for p in params),
            "grads": sum(held(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(held(v) for v in state)}


class HeldPeak:
    """The most bytes of parameters, gradients and optimizer state this rank has held: measured
    before the first optimizer step (an optimizer step pre-hook: the gradients are there then, gone
    after the step's zero_grad) and once more at the end (`measure`: the optimizer state the steps
    made). The shards' sizes do not change from step to step, so the timed steps after the first
    measure nothing."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.peak = {"params": 0, "grads": 0, "optimizer": 0}
        self.hook = optimizer.register_step_pre_hook(self.before_first_step)

    def before_first_step(self, *_) -> None:
        self.measure()
        self.hook.remove()

    def measure(self) -> dict:
        """The peak so far, with this moment's bytes. Every FSDP unit is resharded first: after a
        forward without backward (the last evaluation) the root keeps its parameters all-gathered
        and registered in place of its shards, which would count them whole."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        now = held_bytes(self.model, self.optimizer)
        self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
        return self.peak
