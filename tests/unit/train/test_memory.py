"""The memory ledger (train/memory.py, summary.json's "memory"): each part against an independent
count, for every precision mode and under FSDP on one gloo rank; what it holds at once against a
peak; on a GPU its total beside the device's peak (gpu-marked). What measuring costs: the hooks
out of dynamo, a step with them against one without, the measured step out of the throughput."""
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import TINY, compose_config, run_tiny
from helpers.compiling import CountingBackend
from helpers.configs import ADAM
from helpers.expected import expected_state, fresh_model
from helpers.fakes import with_clock
from mixprec.config import validate
from mixprec.models.gpt import GPT
from mixprec.precision import emulation, modes
from mixprec.precision.policy import PrecisionPolicy
from mixprec.train import memory
from mixprec.train.memory import Ledger, SavedCount, pieces

MODES = ["fp32", "amp", "half", "o2", "bf16", "fp8"]
# every mode: the six above in the quick loop, the other nine slow (a job each)
ALL_MODES = [m if m in MODES else pytest.param(m, marks=pytest.mark.slow) for m in modes.MODES]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_the_ledger_counts_each_part_as_an_independent_count(tmp_path, mode):
    """A real job (small CNN, Adam, CPU, fp16/bf16 emulated): weights, masters, gradients and
    optimizer state as the config says they are (fp32 Adam: 16 bytes a parameter; o2 adds the fp16
    model), GradScaler's two scalars under a dynamic scale, BatchNorm's buffers, and activations
    saved at the measured step (the last of the first log window after the warm-up)."""
    s = run_tiny(tmp_path, f"precision={mode}", *ADAM)
    assert s["status"] == "completed"
    mem, want = s["memory"], expected_state(mode)
    assert mem is not None, "summary.json has no memory ledger"
    for part in ("weights", "masters", "grads", "optimizer", "buffers"):
        assert mem["bytes"][part] == want[part], (part, mem["bytes"], want)
    assert mem["parameters"] == want["parameters"]
    n = want["parameters"]
    assert mem["bytes_per_param"] == pytest.approx(
        sum(want[k] for k in ("weights", "masters", "grads", "optimizer")) / n)
    if mode in ("fp32", "fp8"):
        assert abs(mem["bytes_per_param"] - 16) < 0.01          # fp32 Adam (+ its step scalars)
    if mode == "o2":
        assert 18 <= mem["bytes_per_param"] < 18.1              # + the fp16 model
    scaled = validate(compose_config(*TINY, f"precision={mode}")).precision.loss_scale == "dynamic"
    assert mem["bytes"]["scaler"] == (8 if scaled else 0)       # GradScaler: scale, growth tracker
    assert mem["bytes"]["buffers"] == want["buffers"]
    assert mem["step"] == 2 and mem["samples"] == 16 and mem["bytes"]["activations"] > 0
    assert mem["activation_mb_per_sample"] == mem["bytes"]["activations"] / 2**20 / 16
    assert mem["total_bytes"] == sum(mem["bytes"].values())


def saved_by_graph(loss: torch.Tensor, model: nn.Module) -> int:
    """What the backward graph of `loss` holds, read from its nodes after the forward (each node's
    _saved_* attributes, a custom Function's saved_tensors), each storage once, parameters'
    storages left out: an independent count of what SavedCount sees as autograd saves."""
    params = {key for p in model.parameters() for key, _, _ in pieces(p)}
    seen, total, nodes, stack = set(), 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        stack += [f for f, _ in node.next_functions]
        saved = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        saved += list(getattr(node, "saved_tensors", ()) or ())
        for t in saved:
            for v in (t if isinstance(t, (tuple, list)) else [t]):
                if not isinstance(v, torch.Tensor):
                    continue
                for key, size, _ in pieces(v):
                    if key not in params and key not in seen:
                        seen.add(key)
                        total += size
    return total


def tiny_mlp() -> nn.Module:
    """Linear layers of dims a multiple of 16 (float8's), a BatchNorm, a ReLU."""
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))


@pytest.mark.parametrize("mode", MODES)
def test_saved_activations_match_the_backward_graph(mode):
    """SavedCount (saved_tensors_hooks during the forward) against the backward graph's saved
    tensors read after it, per mode (CPU, fp16/bf16 emulated); autocast's cast of a weight that
    backward needs is a weight copy, counted apart (2 bytes an element under amp), none in the
    modes whose weights are already in their dtype, nor under fp8 (torchao's float8 Linear saves
    its fp32 weight, a view of the parameter, and casts it again in backward)."""
    config = validate(compose_config(*TINY, f"precision={mode}"))
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    torch.manual_seed(0)
    with emulation.numerics(policy.emulated):
        model = policy.prepare_model(tiny_mlp())
        x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
        with SavedCount(model) as count, policy.autocast():
            loss = nn.functional.cross_entropy(model(policy.cast_input(x)).float(), y)
        saved = {k: sum(v.values()) for k, v in count.parts.items()}
        assert saved["activations"] + saved["weight_copies"] == saved_by_graph(loss, model)
        loss.backward()
    # the second layer's weight: the first's is not saved, its input needs no gradient
    weights = 64 * 16
    assert saved["weight_copies"] == (2 * weights if mode == "amp" else 0)
    assert saved["activations"] >= 32 * 32 * (4 if mode in ("fp32", "amp", "fp8") else 2)


def test_fsdp_on_one_rank_counts_its_shards(tmp_path):
    """trainer.strategy=fsdp on one gloo rank (a GPT, amp: fp32 shards stepped, bf16/fp16
    gathered for the forward): the weights are the rank's fp32 shards (the whole model on one
    rank), no separate masters, fp32 gradients and Adam state; the gathered low-precision weights
    autograd saves are the parameters FSDP registered, not activations nor copies."""
    from helpers.configs import GPT_TINY

    s = run_tiny(tmp_path, "precision=amp", "optimizer=adam", "trainer.strategy=fsdp",
                 base=GPT_TINY)
    assert s["status"] == "completed", s.get("error")
    mem = s["memory"]
    config = validate(compose_config(*GPT_TINY))
    tensors = list(fresh_model(config).parameters())
    n = sum(t.numel() for t in tensors)
    assert mem["parameters"] == n
    assert mem["bytes"]["weights"] == 4 * n and mem["bytes"]["masters"] == 0
    assert mem["bytes"]["grads"] == 4 * n
    assert mem["bytes"]["optimizer"] == 8 * n + 4 * len(tensors)
    assert mem["bytes"]["weight_copies"] == 0 and mem["bytes"]["activations"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ledger_sits_under_the_device_peak(tmp_path):
    """On CUDA the ledger's total is at most the peak of allocated bytes after its step, and what it
    leaves out (the backward's activation gradients, cuBLAS/cuDNN workspaces, transient casts, the
    device-resident dataset of 96 small images) is at most the total plus 256 MiB on a small CNN:
    workspaces are tens of MiB, the rest scales with what the ledger counts."""
    s = run_tiny(tmp_path, "precision=amp", *ADAM,
                 base=[o for o in TINY if not o.startswith("trainer.device")])
    mem = s["memory"]
    assert mem["device_peak_allocated_bytes"] >= mem["total_bytes"] >= mem["at_once_bytes"]
    assert 0 <= mem["outside_ledger_bytes"] <= mem["total_bytes"] + 256 * 2**20


def test_the_ledger_reaches_the_block_the_sweep_table_and_the_report(tmp_path, monkeypatch):
    """An o2 job's ledger: a line of the end-of-job block, B/param and activation MB per sample in
    the sweep table, and a stacked bar (one per part it holds, summing to its total) in the
    report."""
    from mixprec.report import analyse, console, plots
    from mixprec.report.make import make_report

    s = run_tiny(tmp_path / "runs" / "o2", "precision=o2", *ADAM)
    mem = s["memory"]
    block = console.job_block(s)
    assert (f"ledger      {mem['total_bytes'] / 2**20:.3g} MB at step 2 (weights "
            f"{mem['bytes']['weights'] / 2**20:.3g}, masters ") in block
    assert f"{mem['bytes_per_param']:.2f} B/param" in block
    table = console.format_table(analyse.sweep_rows([s]))
    head, _, row = table.splitlines()
    assert "B/param" in head and "act MB/sample" in head
    assert f"{mem['bytes_per_param']:.2f}" in row
    assert f"{mem['activation_mb_per_sample']:.3g}" in row
    bars = {}
    real = plots.save

    def keep(fig, path):
        bars[path.name] = [p.get_height() for p in fig.axes[0].patches]
        return real(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    (fig,) = [f for f in data["experiments"][0]["plots"] if f["path"].endswith("_ledger.png")]
    heights = bars[fig["path"].rsplit("/", 1)[1]]
    assert len(heights) == sum(1 for v in mem["bytes"].values() if v)
    assert sum(heights) == pytest.approx(mem["total_bytes"] / 2**20)


@pytest.mark.slow
def test_fsdp_on_two_ranks_counts_each_ranks_half(tmp_path):
    """trainer.strategy=fsdp on 2 gloo ranks under torchrun (every dim-0 of the GPT's parameters
    even): rank 0's ledger holds half of each parameter part, as parallel.held_bytes (another count,
    of numel times element size) says, its Adam state plus the step scalars that count leaves
    out."""
    from helpers.configs import GPT_TINY
    from helpers.distributed import job

    s = job([*GPT_TINY, "optimizer=adam", "precision=amp", "trainer.strategy=fsdp"],
            tmp_path / "two", tmp_path)
    mem, held = s["memory"], s["distributed"]["held_bytes"][0]
    tensors = list(fresh_model(validate(compose_config(*GPT_TINY))).parameters())
    n = sum(t.numel() for t in tensors)
    assert mem["parameters"] == n // 2
    assert mem["bytes"]["weights"] == held["params"] == 2 * n
    assert mem["bytes"]["grads"] == held["grads"] == 2 * n
    steps = 4 * len(tensors)   # Adam's step counters, one fp32 scalar a tensor
    assert mem["bytes"]["optimizer"] == held["optimizer"] + steps == 4 * n + steps


def test_what_the_ledger_holds_at_once_is_the_state_and_the_larger_of_saved_and_grads():
    """outside_ledger_bytes is the device's peak less what the parts held at one moment of the
    measured step: the state it started with (weights, Adam's moments and step counters, BatchNorm's
    buffers) and the larger of what autograd saved (read from the backward graph) and the
    gradients, never both (backward frees the one as it makes the other). A peak that is exactly
    that plus 1000 bytes leaves 1000 bytes outside, where the total, which adds both, is above the
    peak (the old unaccounted_bytes, the peak less the total, went negative); the end-of-job block
    says so."""
    torch.manual_seed(0)
    model = tiny_mlp()
    config = validate(compose_config(*TINY, "precision=fp32"))
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    optimizer = torch.optim.Adam(policy.optimizer_params(policy.prepare_model(model)))
    ledger = Ledger(model, policy, optimizer)
    loop = SimpleNamespace(trainer=SimpleNamespace(log_every=1), warm_at=1, total_steps=2)
    x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
    for step in (1, 2):
        with ledger.around(loop, step):
            loss = nn.functional.cross_entropy(model(x), y)
        saved = saved_by_graph(loss, model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ledger.took(step, 32)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    state = 4 * n + 8 * n + 4 * len(params) + sum(b.nbytes for b in model.buffers())
    assert min(saved, 4 * n) > 1000
    ledger.device_peak = state + max(saved, 4 * n) + 1000
    mem = ledger.summary()
    assert mem["at_once_bytes"] == state + max(saved, 4 * n)
    assert mem["outside_ledger_bytes"] == 1000
    assert mem["total_bytes"] == state + saved + 4 * n > ledger.device_peak
    from mixprec.report import console
    assert (f"{1000 / 2**20:.3g} MB beyond what the parts held at once"
            in console.ledger_line(mem))


class Breaks(nn.Module):
    """Two Linear layers with a graph break between them that dynamo runs eagerly, in the frame it
    evaluates: a boolean mask (an output shape that depends on the data), whose index autograd
    saves there."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        return self.b(x[x.sum(1) > -1e9])


def compiled_steps(ledger: bool) -> tuple[int, int]:
    """Three training steps of Breaks through torch.compile (a counting backend), the second under
    SavedCount when `ledger`: the graphs made and the frames dynamo compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net, backend = Breaks(), CountingBackend()
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(8, 16)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    for step in (1, 2, 3):
        with SavedCount(net) if ledger and step == 2 else memory.contextlib.nullcontext():
            loss = compiled(x).sum()
        loss.backward()
    made = len(backend.graphs), torch._dynamo.utils.counters["frames"]["total"] - frames
    torch._dynamo.reset()
    return made


def test_dynamo_compiles_nothing_of_the_ledgers_hooks():
    """Where a compiled model breaks its graph, autograd calls the pack hook in a frame dynamo
    evaluates: a model measured by the ledger makes the graphs and compiles the frames that it
    makes and compiles without (before torch.compiler.disable, dynamo compiled the hook and pieces()
    for each kind of tensor, up to its recompile limit: 17 frames against 2)."""
    assert compiled_steps(ledger=True) == compiled_steps(ledger=False)


def test_a_step_with_the_hooks_costs_little_more_than_one_without(monkeypatch):
    """A 12-layer GPT's training step (forward under SavedCount, backward) against the same step
    without the hooks: the parameters' storages are collected once, when the count is entered (they
    were collected again at every saved tensor that was not a parameter's: 11 to 14 times the
    step's time on this CPU, under 2 times now). The medians of 7 interleaved steps; the bound, 4,
    depends on the CPU's kernels and torch's version (the hooks cost microseconds a saved tensor,
    the step's kernels little more at this size)."""
    torch.manual_seed(0)
    model = GPT(64, n_layer=12, n_head=2, n_embd=32, block_size=8)
    tokens = torch.randint(0, 64, (8, 2))
    walks, refresh = [], SavedCount.refresh
    monkeypatch.setattr(SavedCount, "refresh", lambda count: walks.append(refresh(count)))

    def step(hooks: bool) -> float:
        t0 = time.perf_counter()
        with SavedCount(model) if hooks else memory.contextlib.nullcontext():
            logits, _ = model(tokens)
        logits.sum().backward()
        return time.perf_counter() - t0

    step(True), step(False)
    times = [(step(True), step(False)) for _ in range(7)]
    ratio = statistics.median(t for t, _ in times) / statistics.median(t for _, t in times)
    assert ratio < 4, f"a step with the hooks takes {ratio:.1f} times one without"
    assert len(walks) == 8   # once a step, at the count's entry


def test_the_measured_step_is_left_out_of_the_steady_throughput(tmp_path, monkeypatch):
    """A fake clock moved 1 s by every training step and 100 s more by the ledger's hooks (made
    slow) at the measured step, step 2 of 3 (warm-up 1, log every 2): the steady throughput is that
    of step 3 alone, 16 samples in 1 s (with the measured step in it: 32 samples in 102 s), and the
    training time holds every second."""
    clock = with_clock(monkeypatch, cost=lambda k: 1.0)
    enter = SavedCount.__enter__

    def slow(count):
        clock.now += 100.0
        return enter(count)
    monkeypatch.setattr(SavedCount, "__enter__", slow)
    s = run_tiny(tmp_path, *ADAM)
    m = s["metrics"]
    assert s["memory"]["step"] == 2 and m["steps"] == 3 and not m["throughput_includes_warmup"]
    assert m["throughput"] == pytest.approx(16.0, rel=1e-9)
    assert m["train_time_s"] == pytest.approx(3 * 1.0 + 100.0, rel=1e-9)
