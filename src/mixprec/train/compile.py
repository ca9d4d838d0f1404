"""trainer.compile: the training model through torch.compile, compiled and warmed up before the
clock starts.

`compile_model(net, mode)` wraps the module the loop trains (the DDP wrapper under several ranks) in
torch.compile with the chosen mode: `default` (inductor), `max-autotune` (inductor, Triton kernels
autotuned, CUDA graphs), `reduce-overhead` (inductor with CUDA graphs), and static shapes
(`dynamic=False`): each shape the warm-up compiles gets a graph of its own, so the shorter last
window of a language model (or the last, partial, evaluation batch) does not make dynamo recompile
with that dimension dynamic, a graph that would then serve every full window. The step calls the
model inside the precision policy's autocast, so autocast is part of the compiled graph: dynamo
traces the forward under the ambient autocast state and guards on it (a change of state recompiles).
The compiled module shares its parameters and buffers with the model: optimizer, EMA, checkpoints
and the saved weights use the plain model and see the same tensors. Image models and the GPT are
compiled; precision=fp8 compiles the float8-converted model, as torchao intends (its Float8Linear
casts fuse into the matmuls' neighbours under inductor). The RNN language models stay eager
(RNN_EAGER says why). Under FSDP each unit (GPT block, ResNet stage) is compiled before
fully_shard (train/parallel.py's compile_units, as torchtitan does) and compile_model leaves the
sharded root as it is; the warm-up's recompile limit counts the units (recompile_limit).

One process, many jobs (a Hydra sweep): dynamo's caches are per process and keyed by code objects
that every job's model shares, so each compiled job would add its graphs to the earlier jobs' until
dynamo's recompile limit, and from then on run eagerly. `reset_compile_state(device)` starts each
job afresh (job.train_job calls it first; a script that compiles several models in one process
should call it between them): dynamo's caches, the CUDA-graph trees and their memory pools, the
device's cached blocks. `GraphWatch` records what a job's compilation did: the graphs dynamo
compiled (`compiled_graphs`), the graph breaks it took while compiling them (`graph_breaks`: each
splits a compiled module into one more graph, its pieces still compiled; 0 when every compiled
module, each FSDP unit included, is one graph a shape and mode), and the calls of the compiled
model after the warm-up that ran eagerly (`eager_calls`; under FSDP the calls of each layer with
weights inside a compiled unit, `watched`); breaks and eager calls are said in one warning line and
in the job block and the sweep table when not 0.

Stop signals: inductor compiles Triton kernels in a pool of worker processes, in the job's process
group, and caches the pool: a SIGTERM sent to the group (`timeout`, scancel, a terminal) would kill
it, and every later compile in the process fails ("Attempting to use a closed pool").
`start_compile_workers()` starts the pool before the first compile with the stop signals blocked, a
mask its processes inherit: they leave stopping to the job (as the DataLoader's workers do), which
compiles on, trains a step and stops with its checkpoint.

CUDA graphs (`reduce-overhead`, `max-autotune`): a graph's outputs live in a memory pool that its
next replay overwrites. The loop therefore calls `mark_step(mode)`
(torch.compiler.cudagraph_mark_step_begin) at the start of every training step and before every
evaluation call, and keeps no compiled output past it: the losses and counts it keeps for the log
flush are computed from the outputs by eager ops, and an evaluation call whose output outlives the
next call (flip TTA) goes through `GraphCalls`, which clones it.

`warm_compile(net, policy, mode, warmup)` compiles now, outside the training clock, and returns the
seconds it took (recorded as `compile_time_s`, apart from `train_time_s`): for each shape the loop
will see (`Warmup`: the training batch; the evaluation batch and the last, partial, evaluation
batch; a language model's full and last window), forward and backward in training mode, and the
no-grad forward in eval mode, each called `calls_per_shape(mode)` times: once for inductor, three
times under CUDA graphs (cudagraph trees run a shape eagerly on its first call, record it on the
second and replay from the third), so neither a compilation, an autotuning nor a graph recording
falls in the timed steps. Under CUDA graphs every shape is warmed a second time after all: that pass
was needed while a second shape made dynamo recompile with that dimension dynamic (cudagraph trees
then recorded the new graph anew for each size, the first one included); with static shapes it
should find nothing left to record, and it stays until a GPU run shows that. Afterwards every
parameter, buffer (BatchNorm statistics) and gradient is put back as it was and the torch RNGs are
restored, so the run trains exactly as an uncompiled one would (within inductor's rounding).
"""
from __future__ import annotations

import concurrent.futures
import gc
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..runtime.hardware import fork_rng, synchronize
from ..runtime.signals import StopSignals
from ..models import set_bn_eval

log = logging.getLogger(__name__)

# the longest wait for inductor's compile workers to start (start_compile_workers)
POOL_WAIT_S = 120
GRAPH_MODES = ("reduce-overhead", "max-autotune")   # the modes that run CUDA graphs
RNN_EAGER = (
    "the RNN language models run eagerly: torch.compile does not trace nn.LSTM/GRU/RNN (dynamo "
    "graph-breaks around them, torch._dynamo.config.allow_rnn), cuDNN already runs each layer as "
    "one fused kernel, and their hidden state carried from window to window would be a CUDA "
    "graph's output kept across steps"
)


def compile_model(net: nn.Module, mode: str, backend="inductor", options: dict | None = None
                  ) -> nn.Module:
    """`net` through torch.compile in `mode` with static shapes (the module's note); `net` itself
    under "none", and when its parts were compiled already (FSDP's units, compiled before
    fully_shard: `compiled_parts`). backend: inductor, or a test's counting backend (a callable:
    `mode` and `options` are inductor's, not passed). options: inductor's settings on top of the
    mode's (precision/fp8.inductor_options)."""
    if mode == "none" or compiled_parts(net):
        return net
    if backend != "inductor":
        return torch.compile(net, backend=backend, dynamic=False)
    if options:
        options = {**torch._inductor.list_mode_options(mode), **options}
        return torch.compile(net, dynamic=False, options=options)
    return torch.compile(net, mode=mode, dynamic=False)


def compiled_parts(net: nn.Module) -> list[nn.Module]:
    """The modules inside `net` that torch.compile wrapped in place of themselves (the units of an
    FSDP model, train/parallel.py): each one's own module, which its compiled frame calls."""
    wrapper = torch._dynamo.eval_frame.OptimizedModule
    return [m._orig_mod for m in net.modules() if isinstance(m, wrapper)]


def reset_compile_state(device: torch.device | None = None) -> None:
    """Forget every earlier compilation of this process, as a new process would start: dynamo's code
    caches and guards (torch._dynamo.reset, which also resets the CUDA-graph trees when CUDA is
    initialised), then the objects they kept alive, then the device's cached blocks (the graphs'
    memory pools among them). The cycle collector runs only when dynamo converted a frame since its
    last reset: a full collection of a large process is slow, and without a compilation there is
    nothing of dynamo's to free (a finished job frees its own model without it)."""
    compiled = getattr(torch._dynamo.convert_frame, "FRAME_COUNTER", 1) != 0
    torch._dynamo.reset()
    if compiled:
        gc.collect()
    module = None if device is None else torch.get_device_module(device)
    if hasattr(module, "empty_cache"):
        module.empty_cache()


def start_compile_workers() -> None:
    """Start inductor's compile-worker pool (the Triton backend's; nothing without Triton) with the
    stop signals blocked in this thread while it starts: its processes inherit the mask, so a
    SIGTERM sent to the job's process group leaves them running. Here the signals wait until the
    mask is restored: none is lost. A pool started earlier in the process is kept as it is."""
    if not hasattr(signal, "pthread_sigmask"):   # Windows: inductor compiles in the process there
        return
    # lazy: inductor's import takes seconds, and only a compiled job on an accelerator needs it
    from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, StopSignals.SIGNALS)
    try:
        maybe_warm_pool()
        # until the pool is ready inductor compiles in this process (its ptxas in the job's
        # process group, in reach of a SIGTERM): wait for it, outside the training clock
        AsyncCompile.wait_pool_ready(timeout=POOL_WAIT_S)
    # the pool's future raises concurrent.futures.TimeoutError: the builtin from Python 3.11, its
    # own class on 3.10 (pyproject allows 3.10)
    except (TimeoutError, concurrent.futures.TimeoutError):
        log.warning(
            f"mixprec: note: inductor's compile workers were not ready after {POOL_WAIT_S} s; "
            "compiling in this process"
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (one more at every compilation or
    recompilation)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    """Graph breaks dynamo has taken in this process (counted per reason: an unsupported op, a
    dynamo-disabled hook such as FSDP's, torch._dynamo.graph_break())."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


class EagerCalls:
    """A forward pre-hook counting the calls of a module that run outside a compiled graph: dynamo
    traces it with torch.compiler.is_compiling() True (so it adds nothing to the graph), a graph's
    call never runs it, and a call dynamo gave up on (the recompile limit, a frame it skipped) runs
    it eagerly."""

    def __init__(self):
        self.count = 0

    def __call__(self, module: nn.Module, args) -> None:
        if not torch.compiler.is_compiling():
            self.count += 1


def watched(net: nn.Module, mode: str) -> list[nn.Module]:
    """The modules whose eager calls a job counts: the compiled model; under FSDP (its units
    compiled, its root eager) every layer with weights inside a compiled unit, whose call runs
    eagerly where the unit's graph stops: a whole unit that dynamo gave up on, and the stretches
    between graph breaks (whose pieces dynamo compiles again, so that a broken unit is counted in
    GraphWatch's graph_breaks rather than here)."""
    if mode == "none":
        return []
    parts = compiled_parts(net)
    if not parts:
        return [net]
    return [m for part in parts for m in part.modules()
            if next(m.parameters(recurse=False), None) is not None]


class GraphWatch:
    """What a job's compiled model did: the graphs dynamo compiled from its creation (at the job's
    start, after reset_compile_state), the graph breaks it took, and the calls after the warm-up
    that ran eagerly. Nothing for an eager job. `optimizer`: the graphs dynamo compiles inside its
    steps (torchao's AdamW on CUDA compiles its step per parameter shape) are the optimizer's,
    counted apart from the model's."""

    def __init__(self, net: nn.Module, mode: str, optimizer: torch.optim.Optimizer | None = None):
        self.mode, self.graphs_at_start, self.eager_at_warm = mode, dynamo_graphs(), 0
        self.breaks_at_start = graph_breaks()
        self.eager = EagerCalls()
        self.handles = [m.register_forward_pre_hook(self.eager) for m in watched(net, mode)]
        self.optimizer_graphs, self._at_step = 0, 0
        if optimizer is not None:
            self.handles += [optimizer.register_step_pre_hook(self._step_starts),
                             optimizer.register_step_post_hook(self._step_ends)]

    def _step_starts(self, *_) -> None:
        self._at_step = dynamo_graphs()

    def _step_ends(self, *_) -> None:
        self.optimizer_graphs += dynamo_graphs() - self._at_step

    def warmed(self) -> None:
        self.eager_at_warm = self.eager.count

    def finish(self) -> dict:
        """The job's `compiled_graphs` (the model's), `graph_breaks` and `eager_calls` (metrics),
        with `optimizer_graphs` where its steps compiled; a warning line when calls ran eagerly,
        another when dynamo broke the graphs."""
        for handle in self.handles:
            handle.remove()
        optimizer = {"optimizer_graphs": self.optimizer_graphs} if self.optimizer_graphs else {}
        if self.mode == "none":
            return optimizer
        eager = self.eager.count - self.eager_at_warm
        breaks = graph_breaks() - self.breaks_at_start
        if eager:
            log.warning(f"mixprec: trainer.compile={self.mode}: {eager} calls of the compiled "
                        "model after its warm-up ran eagerly (dynamo gave up on them; "
                        "TORCH_LOGS=recompiles says why): this job's time is partly an eager time")
        if breaks:
            log.warning(f"mixprec: trainer.compile={self.mode}: dynamo broke the compiled graphs "
                        f"{breaks} time{'s' if breaks > 1 else ''} (TORCH_LOGS=graph_breaks says "
                        "where): the compiled "
                        "modules ran in pieces, with eager code between them")
        graphs = dynamo_graphs() - self.graphs_at_start - self.optimizer_graphs
        return {"compiled_graphs": graphs, "graph_breaks": breaks, "eager_calls": eager,
                **optimizer}


def mark_step(mode: str) -> None:
    """A new CUDA-graph step begins (the previous step's graph outputs may be overwritten from here
    on)."""
    if mode in GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def calls_per_shape(mode: str) -> int:
    """Calls that leave nothing for the clock: 1 compiles; CUDA graphs record on the 2nd call and
    replay from the 3rd."""
    return 3 if mode in GRAPH_MODES else 1 if mode != "none" else 0


class GraphCalls:
    """An evaluation model whose every call starts a CUDA-graph step and returns a clone, so that an
    output kept past the next call (flip TTA's first logits) is not overwritten by it.
    train()/eval() reach the model."""

    def __init__(self, model: nn.Module, mode: str):
        self.model, self.mode = model, mode

    def __call__(self, *args):
        mark_step(self.mode)
        return self.model(*args).clone()

    def train(self, mode: bool = True):
        return self.model.train(mode)

    def eval(self):
        return self.model.eval()


@dataclass
class Warmup:
    """The shapes a run's compiled model will see and how to make a batch of each. `batch(shape,
    generator, device)` -> (x, y); `loss(net, policy, x, y)` -> the training loss; `infer(net,
    policy, x, y)` the evaluation forward (run under no_grad in eval mode). bn_eval: BatchNorm stays
    in eval mode while training."""
    train_shapes: list
    eval_shapes: list
    batch: Callable
    loss: Callable
    infer: Callable
    bn_eval: bool = False
    # filled by warm_compile: (training?, shape) in the order warmed
    shapes: list = field(default_factory=list)


def warm_compile(net: nn.Module, policy, mode: str, warmup: Warmup) -> float:
    """Compile and warm `net` for every shape of `warmup`, training and evaluation; leave its state
    as it was."""
    if mode == "none":
        return 0.0
    device = policy.device
    synchronize(device)
    start = time.perf_counter()
    saved = {k: v.detach().clone() for k, v in net.state_dict().items()}
    with fork_rng(device), torch._dynamo.config.patch(recompile_limit=recompile_limit(net)):
        gen = torch.Generator(device=device).manual_seed(0)
        # see warm_compile's note on a second pass
        for _ in range(2 if mode in GRAPH_MODES else 1):
            for shape in warmup.train_shapes:
                warm_training(net, policy, mode, warmup, warmup.batch(shape, gen, device))
                warmup.shapes.append((True, shape))
            warm_evaluation(net, policy, mode, warmup, gen)
        with torch.no_grad():
            for k, v in net.state_dict().items():
                v.copy_(saved[k])
        for p in net.parameters():
            p.grad = None
    synchronize(device)
    return time.perf_counter() - start


def recompile_limit(net: nn.Module) -> int:
    """Dynamo's recompile limit while the warm-up compiles `net`: its own for a model compiled
    whole; under FSDP that limit times the compiled units. Dynamo counts its graphs per code
    object, and every unit's wrapper runs the same one (nn.Module's call): the 4 ResNet stages,
    each in training and in evaluation on 2 batch shapes, are 12 graphs of one code object, past
    the default 8, and the rest of the stages ran eagerly. After the warm-up the limit is dynamo's
    again: a recompilation in the timed steps is refused and counted as eager calls."""
    return torch._dynamo.config.recompile_limit * max(1, len(compiled_parts(net)))


def warm_evaluation(
    net: nn.Module, policy, mode: str, warmup: Warmup, gen: torch.Generator
) -> None:
    """The no-grad eval-mode forward of each evaluation shape, as many times as `mode` needs; back
    in training mode."""
    net.eval()
    with torch.no_grad():
        for shape in warmup.eval_shapes:
            x, y = warmup.batch(shape, gen, policy.device)
            for _ in range(calls_per_shape(mode)):
                mark_step(mode)
                warmup.infer(net, policy, x, y)
            warmup.shapes.append((False, shape))
    net.train()


def warm_training(net: nn.Module, policy, mode: str, warmup: Warmup, batch: tuple) -> None:
    """The training forward and backward of one batch shape, as many times as `mode` needs."""
    net.train()
    if warmup.bn_eval:
        set_bn_eval(net)
    for _ in range(calls_per_shape(mode)):
        mark_step(mode)
        warmup.loss(net, policy, *batch).float().backward()
        for p in net.parameters():
            p.grad = None
