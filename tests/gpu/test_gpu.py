"""What only a CUDA GPU can show (marked gpu: skipped without one; `pytest -m gpu`, about a minute
on one GPU). Each test guards a CUDA-only branch or a CUDA behaviour the CPU suite cannot see
(docs/gpus.md).
"""
import time
import warnings

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from torch import nn

from helpers import TINY, compose_config, run_tiny, load_script
from mixprec.train import checkpoint, warmup
from mixprec import data
from mixprec.precision.policy import PrecisionPolicy
from mixprec.config import validate
from mixprec.train.loop import LoopState, TrainClock
from mixprec.models import small_cnn
from mixprec.train.optim import build_optimizer
from mixprec.train.step import backward_and_step
from mixprec.models.resnet9 import GhostBatchNorm
from mixprec.models.rnnlm import RNNModel
from mixprec.precision import emulation
from mixprec.precision import modes
from mixprec.precision.state import load_module_state
from mixprec.runtime.hardware import fork_rng

pytestmark = pytest.mark.gpu
GPU_TINY = [o for o in TINY if not o.startswith("trainer.device")]   # trainer.device=auto: the GPU
# model.width is small_cnn's alone
GPU_ANY_MODEL = [o for o in GPU_TINY if not o.startswith("model")]
CUDA0 = torch.device("cuda", 0)


def test_a_default_device_job_completes_and_saves_portable_weights(tmp_path):
    s = run_tiny(tmp_path, base=GPU_TINY)
    assert s["status"] == "completed", s.get("error")
    assert (
        s["env"]["device"] == "cuda:0" and s["metrics"]["peak_memory_kind"] == "cuda_max_allocated"
    )
    # no map_location: saved on the CPU
    weights = torch.load(tmp_path / checkpoint.WEIGHTS, weights_only=True)
    assert {v.device.type for v in weights.values()} == {"cpu"}


def test_o2_weights_equal_their_masters_after_a_step():
    config = validate(
        compose_config(
            "precision=o2", "precision.init_scale=1", "optimizer=sgd", "optimizer.lr=0.5"
        )
    )
    policy = PrecisionPolicy(config.precision, CUDA0)
    model = policy.prepare_model(small_cnn(8, 10))
    opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
    x, y = torch.randn(16, 3, 32, 32, device=CUDA0), torch.randint(0, 10, (16,), device=CUDA0)
    loss = nn.functional.cross_entropy(model(policy.cast_input(x)).float(), y)
    assert backward_and_step(loss, policy, opt) is False
    # BN stays fp32
    assert {p.dtype for p in policy.model_params} == {torch.float16, torch.float32}
    for p, master in zip(policy.model_params, policy.master_params):
        assert torch.equal(p, master.to(p.dtype))


def test_tf32_then_fp32_jobs_in_one_process_record_their_flags(tmp_path):
    tf32 = run_tiny(tmp_path / "a", "precision=tf32", base=GPU_TINY)
    fp32 = run_tiny(tmp_path / "b", "precision=fp32", base=GPU_TINY)
    assert (tf32["env"]["tf32_matmul"], tf32["env"]["tf32_cudnn"]) == (True, True)
    assert (fp32["env"]["tf32_matmul"], fp32["env"]["tf32_cudnn"]) == (False, False)
    assert fp32["env"]["job_in_process"] == tf32["env"]["job_in_process"] + 1


def test_an_amp_step_syncs_the_host_at_most_once():
    config = validate(compose_config("precision=amp", "optimizer=sgd"))
    policy = PrecisionPolicy(config.precision, CUDA0)
    model = policy.prepare_model(small_cnn(8, 10))
    opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
    x, y = torch.randn(16, 3, 32, 32, device=CUDA0), torch.randint(0, 10, (16,), device=CUDA0)

    def step():
        with policy.autocast():
            out = model(policy.cast_input(x))
        backward_and_step(nn.functional.cross_entropy(out.float(), y), policy, opt)
        opt.zero_grad(set_to_none=True)

    for _ in range(3):   # warm-up: lazy init, autotuning
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]   # GradScaler's found-inf check only
    assert policy.scale_value == policy.scaler.get_scale()


@pytest.mark.parametrize(
    "mode, rnn_dtype, cudnn",
    [
        ("amp", torch.float16, True),
        ("amp_bf16", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("fp32", torch.float32, True),
    ],
)
def test_the_rnn_runs_in_the_dtype_it_records(mode, rnn_dtype, cudnn):
    policy = PrecisionPolicy(
        validate(compose_config(f"precision={mode}")).precision, CUDA0
    )
    model = policy.prepare_model(RNNModel("lstm", 50, 16, 16, 2))
    tokens = torch.randint(0, 50, (7, 4), device=CUDA0)
    with policy.autocast():
        out, _ = model(tokens, model.init_hidden(4))
    assert (model.rnn_dtype, model.rnn_cudnn) == (rnn_dtype, cudnn)
    assert torch.isfinite(out.float()).all()


def test_a_tiny_job_after_a_big_one_reports_its_own_peak(tmp_path):
    # no autotuning workspaces in either
    fixed = ["trainer.warmup_steps=1", "trainer.cudnn_benchmark=false"]
    big = run_tiny(
        tmp_path / "big",
        "model=resnet18",
        "trainer.batch_size=256",
        "dataset.train_size=512",
        *fixed,
        base=GPU_ANY_MODEL,
    )
    tiny = run_tiny(tmp_path / "tiny", *fixed, base=GPU_TINY)
    assert big["status"] == tiny["status"] == "completed"
    assert tiny["metrics"]["peak_memory_mb"] < big["metrics"]["peak_memory_mb"] / 10
    for m in (big["metrics"], tiny["metrics"]):   # the steady-state peak is within the job's peak
        assert 0 < m["peak_memory_steady_mb"] <= m["peak_memory_mb"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_layouts_are_as_configured(channels_last):
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    batches = data.DeviceBatches(
        images,
        torch.arange(64),
        16,
        (0.5,) * 3,
        (0.25,) * 3,
        device=CUDA0,
        train=True,
        crop_padding=4,
        flip=True,
        channels_last=channels_last,
    )
    x, _ = next(iter(batches))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert x.is_contiguous(memory_format=fmt)
    bn = GhostBatchNorm(3, 4).to(CUDA0)
    assert bn(x).is_contiguous(memory_format=fmt)


def test_max_batch_returns_memory_to_its_baseline_after_an_oom_probe():
    max_batch = load_script("max_batch")
    GlobalHydra.instance().clear()
    config = max_batch.compose(["model=resnet18", "precision=amp"])
    fits = max_batch.make_probe(config, CUDA0)
    # first: what stays for the process (cuBLAS's workspace) is in the baseline
    assert fits(8) is True
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(CUDA0)
    assert fits(1 << 22) is False   # 4M CIFAR images: the batch or its activations exceed any GPU
    assert torch.cuda.memory_allocated(CUDA0) == baseline
    assert fits(8) is True and torch.cuda.memory_allocated(CUDA0) == baseline


def test_the_training_clock_times_queued_gpu_work():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10**8)   # spin ~0.05-0.1 s on the GPU; the host returns at once
    end.record()
    torch.cuda.synchronize()
    gpu_s = start.elapsed_time(end) / 1000
    clock = TrainClock(CUDA0)
    clock.start()
    t0 = time.perf_counter()
    torch.cuda._sleep(10**8)
    queued_s = time.perf_counter() - t0
    elapsed = clock.stop()
    assert queued_s < gpu_s / 2 and elapsed == pytest.approx(gpu_s, rel=0.25)


def test_determinism_after_cuda_init_is_reported_not_assumed(monkeypatch):
    torch.zeros(1, device=CUDA0)   # CUDA is initialised in this process
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    config = validate(compose_config("trainer.deterministic=true"))
    try:
        notes = modes.configure(CUDA0, config.trainer, config.precision, config.seed)
    finally:
        torch.use_deterministic_algorithms(False)
    assert any("CUBLAS_WORKSPACE_CONFIG=:4096:8" in n for n in notes)


def test_the_gpu_rng_state_round_trips_on_the_jobs_device():
    torch.cuda.set_device(CUDA0)
    state = checkpoint.rng_state()
    a = torch.rand(4, device=CUDA0)
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=CUDA0), a)


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "emulated"])
def test_an_lstm_checkpoint_loads_on_the_gpu_into_flat_cudnn_weights(emulate):
    """checkpoint restores a model through precision.state.load_module_state, which drops an RNN's
    weak references to its weights around the load and rebuilds them (on a GPU: cuDNN's one flat
    weight buffer). The loaded LSTM gives the saved one's output, with no warning that its weights
    are not one contiguous chunk."""
    torch.manual_seed(0)
    saved, loaded = nn.LSTM(8, 16, 2).to(CUDA0), nn.LSTM(8, 16, 2).to(CUDA0)
    with emulation.numerics(emulate):
        load_module_state(loaded, saved.state_dict())
    x = torch.randn(5, 3, 8, device=CUDA0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = loaded(x)[0]
    torch.testing.assert_close(out, saved(x)[0])


@pytest.mark.parametrize("mode", ["fp32", "amp", "half", "bf16", "amp_bf16"])
def test_an_rnn_job_never_runs_uncompacted_weights(mode):
    """After the dtype change (prepare_model), prewarm's deepcopy and a checkpoint load, every RNN's
    weights are cuDNN's one chunk (hardware.flatten_rnns): no step warns that cuDNN compacts them at
    every call. bf16 weights too: flatten_parameters refuses bf16 (CUDNN_TENSOR_DTYPES) where ATen's
    RNN runs it on cuDNN (the H200 warning)."""
    config = validate(compose_config(f"precision={mode}", "model=lstm", "optimizer.momentum=0"))
    policy = PrecisionPolicy(config.precision, CUDA0)
    tokens = torch.randint(0, 50, (7, 4), device=CUDA0)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*not part of single contiguous chunk of memory.*"
        )
        model = policy.prepare_model(RNNModel("lstm", 50, 16, 16, 2))
        opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
        warmup.prewarm_lm(model, policy, opt, 1, bptt=6, columns=4, vocab_size=50)
        saver, state = checkpoint.Checkpointer(".", meta={}), LoopState()
        saver.parts["model"] = model
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        saver.restore(
            {
                "parts": {"model": saved},
                "rng": [checkpoint.rng_state()],
                "loop": state.state_dict(),
            },
            state,
        )
        with policy.autocast():
            out, _ = model(tokens, model.init_hidden(4))
    assert torch.isfinite(out.float()).all()


def test_the_probes_counts_make_no_host_sync():
    """probe=ranges measures every tensor of a probed step on the GPU: its counts (histogram
    included) queue kernels only; the probe copies them to the host once per step."""
    from mixprec.numerics import probe_stats

    x = torch.randn(4096, device=CUDA0)
    x[::7], x[1::11], x[2::13] = 0.0, float("inf"), float("nan")
    expected = probe_stats.tensor_counts(x.cpu())
    probe_stats.tensor_counts(x)   # CUDA's lazy initialisation out of the way
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts, absmax = probe_stats.tensor_counts(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(counts.cpu(), expected[0]) and absmax.item() == expected[1].item()


def test_fork_rng_leaves_the_cpu_and_the_gpu_generators_as_they_were():
    """hardware.fork_rng (prewarm and compile's warm-up): draws inside it move neither the CPU's
    nor the GPU's generator."""
    torch.manual_seed(0)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(0)
    with fork_rng(CUDA0):
        torch.rand(8), torch.rand(8, device=CUDA0)
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(0), gpu)
