"""CUDA paths checked on the CPU: PyTorch's own validators run, only the device queries are patched
(a fake 2-GPU machine); the rest of each path runs as on a GPU. What needs a real GPU is in
tests/gpu/test_gpu.py."""
import pytest
import torch
from torch import nn

from helpers import ROOT, compose_config, load_test_module, run_tiny
from mixprec.train import checkpoint
from mixprec import data
from mixprec.runtime import dist, hardware
from mixprec.precision.policy import PrecisionPolicy
from mixprec.config import ConfigError, PrecisionConfig, validate
from mixprec.train.loop import LoopState
from mixprec.models import small_cnn
from mixprec.train.optim import build_optimizer
from mixprec.train.step import backward_and_step
from mixprec.models.resnet9 import GhostBatchNorm, ResNet9
from mixprec.precision import modes
from mixprec.train import parallel
import mixprec.train.parts

CUDA = torch.device("cuda")


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with 2 visible CUDA devices, as far as the device queries go (this wheel is a CUDA
    build, so torch.accelerator.current_accelerator() is cuda already; it asks
    torch.cuda.is_available whether one is visible). set_device_index's C call is recorded instead
    of made."""
    # a CUDA build (the wheel README names)
    assert torch.accelerator.current_accelerator().type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setDeviceIndex", calls.append)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return calls


def test_the_default_device_has_an_index_that_set_device_accepts(two_gpus):
    # the bug this guards: torch.device("cuda") has no index, and PyTorch's validator refuses it
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        # torch/accelerator/_utils.py _get_device_index
        torch.accelerator.set_device_index(torch.device("cuda"))
    assert hardware.select_device("auto") == torch.device("cuda", 0)
    assert hardware.select_device("cuda") == torch.device("cuda", 0)
    assert hardware.select_device("cuda:1") == torch.device("cuda", 1)
    assert hardware.select_device("cpu") == torch.device("cpu")
    with pytest.raises(
        ConfigError, match=r"trainer.device=cuda:2: only 2 cuda device\(s\) visible"
    ):
        hardware.select_device("cuda:2")
    config = validate(compose_config("precision=fp32"))
    modes.configure(hardware.select_device("auto"), config.trainer, config.precision, config.seed)
    modes.configure(hardware.select_device("cuda:1"), config.trainer, config.precision, config.seed)
    # the real torch.accelerator.set_device_index ran, with validated indices
    assert two_gpus == [0, 1]


def test_no_gpu_visible_is_a_config_error_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware.select_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="trainer.device=cuda: no CUDA device is visible here"):
        hardware.select_device("cuda")
    with pytest.raises(
        ConfigError,
        match="^--device=cuda: no CUDA device is visible here; use --device=auto or cpu$",
    ):
        # a script's own flag (bench_pipeline, max_batch)
        hardware.select_device("cuda", option="--device")


def test_one_gpu_per_rank(two_gpus, monkeypatch):
    ranks = [dist.Ranks(rank=r, world=2, local_rank=r) for r in range(2)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [dist.device_name("auto", r) for r in ranks] == ["cuda:0", "cuda:1"]
    assert [dist.device_name("cpu", r) for r in ranks] == ["cpu", "cpu"]
    # torchrun --nproc_per_node=3 on 2 GPUs: every rank refuses
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for r in ranks:
        with pytest.raises(
            ConfigError,
            match=r"3 ranks on this node but 2 cuda device\(s\) visible.*nproc_per_node=2",
        ):
            dist.device_name("auto", r)
    assert dist.device_name("cpu", ranks[0]) == "cpu"   # a CPU job is not limited by the GPUs
    assert dist.backend() == "cpu:gloo,cuda:nccl"
    assert dist.backend_for(torch.device("cpu")) == "gloo" and dist.backend_for(CUDA) == "nccl"


def test_sync_bn_does_not_silently_replace_ghost_bn():
    ranks = dist.Ranks(rank=0, world=2)
    with pytest.raises(
        ConfigError, match="trainer.sync_bn=true: GhostBatchNorm would become plain SyncBatchNorm"
    ):
        parallel.wrap(ResNet9(10, (4, 4, 4, 4), ghost_splits=2), CUDA, True, ranks)


def test_mfu_counts_every_gpu_of_the_job():
    m = {"train_flops_per_sample": 3e9, "throughput": 2000.0}   # global samples/s over 2 ranks
    profile = {"peak_tflops": {"fp16": 30.0}}
    assert hardware.mfu(m, profile, "fp16") == pytest.approx(3e9 * 2000 / 30e12)
    assert hardware.mfu(m, profile, "fp16", world=2) == pytest.approx(3e9 * 2000 / (2 * 30e12))
    assert hardware.mfu(m, {"peak_tflops": None}, "fp16", world=2) is None


@pytest.mark.parametrize(
    "name, matched",
    [
        ("NVIDIA H100 80GB HBM3", True),
        ("nvidia h100 80gb hbm3 ", True),
        ("NVIDIA H100 PCIe", False),
        ("NVIDIA H100 NVL", False),
        ("cpu", False),
    ],
)
def test_gpu_profiles_match_the_full_device_name(name, matched):
    gpu = validate(compose_config("gpu=h100")).gpu
    profile = hardware.gpu_profile(gpu, name)
    assert profile["matched"] is matched
    assert (profile["peak_tflops"] is not None) is matched
    if not matched:
        assert f"but this job ran on '{name}'" in profile["note"]


AUTO_NAMES = [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla V100-SXM2-32GB", "v100_32gb"),
    ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
    ("NVIDIA GeForce GTX 1080 Ti", "gtx1080ti"),
]


@pytest.mark.parametrize("name, expected", AUTO_NAMES)
def test_gpu_auto_picks_the_profile_that_matches_the_device_name(name, expected):
    auto = validate(compose_config("gpu=auto")).gpu
    profile = hardware.gpu_profile(auto, name)
    assert (profile["name"], profile["matched"], profile["chosen_by"]) == (expected, True, "auto")
    m = {"train_flops_per_sample": 3e9, "throughput": 2000.0}
    assert hardware.mfu(m, profile, "fp32") == pytest.approx(
        3e9 * 2000 / (profile["peak_tflops"]["fp32"] * 1e12)
    )


def test_every_profile_names_only_cards_of_its_memory_and_no_card_has_two_profiles():
    """A device name that says its memory ('Tesla V100-SXM2-32GB') matches a profile of it."""
    import re

    seen = {}
    for gpu in hardware.known_profiles():
        for name in gpu.match:
            said = re.search(r"(\d+)GB", name)
            assert said is None or int(said[1]) == gpu.memory_gb, (gpu.name, name, gpu.memory_gb)
            assert seen.setdefault(name.strip().lower(), gpu.name) == gpu.name, name


def test_gpu_auto_on_an_unknown_card_logs_one_line_and_shows_no_mfu(caplog):
    from mixprec import job

    config = validate(compose_config("gpu=auto", "trainer.device=cpu"))
    profile = hardware.gpu_profile(config.gpu, "NVIDIA L4")
    assert profile["matched"] is False and profile["peak_tflops"] is None
    assert (
        hardware.mfu({"train_flops_per_sample": 3e9, "throughput": 2000.0}, profile, "fp32") is None
    )
    with caplog.at_level("INFO"):
        job.warn_if_slow(config, torch.device("cpu"), profile)
    lines = [r.message for r in caplog.records if "NVIDIA L4" in r.message]
    assert len(lines) == 1 and "no profile in conf/gpu/ matches 'NVIDIA L4'" in lines[0]
    # a CPU job: no profile, nothing logged
    assert hardware.gpu_profile(config.gpu, "cpu")["matched"] is None


def test_the_h200_profile_has_the_h100_sxm_compute_and_its_own_memory():
    h100, h200 = (validate(compose_config(f"gpu={n}")).gpu for n in ("h100", "h200"))
    assert h200.peak_tflops == h100.peak_tflops
    assert h200.peak_tflops["fp8"] == pytest.approx(2 * h200.peak_tflops["bf16"], abs=0.2)
    assert (h200.memory_gb, h200.bandwidth_gbs) == (141, 4800) and "H200" in h200.source
    # gpu=h100 on the H200: not used
    assert hardware.gpu_profile(h100, "NVIDIA H200")["matched"] is False


def test_a_devices_precision_notes_go_through_logging(monkeypatch, caplog):
    """modes.configure's notes (here a V100's for amp_bf16) reach the "mixprec" logger, so a job's
    train.log keeps them and ranks other than 0 stay quiet (runtime/logs.py), as every other
    note."""
    monkeypatch.setattr(modes.hardware, "configure", lambda device, trainer, seed: [])
    monkeypatch.setattr(modes.hardware, "capability", lambda device: (7, 0))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    config = validate(compose_config("precision=amp_bf16"))
    with caplog.at_level("INFO", logger="mixprec"):
        notes = modes.configure(CUDA, config.trainer, config.precision, config.seed)
    assert len(notes) == 1 and "below compute capability 8.0" in notes[0]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("mixprec")] == [
        f"mixprec: note: {notes[0]}"
    ]


def test_pre_ampere_gpus_get_a_note_for_bf16_and_tf32():
    prec = {
        n: validate(compose_config(f"precision={n}")).precision
        for n in ("amp_bf16", "bf16", "tf32", "amp")
    }
    assert "bfloat16 has no tensor-core support below compute capability 8.0 (this GPU: 7.0)" in \
        modes.precision_notes(prec["amp_bf16"], (7, 0))[0]
    assert len(modes.precision_notes(prec["bf16"], (6, 1))) == 1
    assert "TF32 needs compute capability 8.0" in modes.precision_notes(prec["tf32"], (7, 5))[0]
    assert modes.precision_notes(prec["amp"], (7, 0)) == []
    assert all(
        modes.precision_notes(p, (8, 0)) == [] and modes.precision_notes(p, None) == []
        for p in prec.values()
    )


def test_o2_copies_masters_back_one_dtype_per_foreach_call(monkeypatch):
    config = validate(
        compose_config(
            "precision=o2", "precision.init_scale=1", "optimizer=sgd", "optimizer.lr=0.5"
        )
    )
    torch.manual_seed(0)
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    model = policy.prepare_model(small_cnn(4, 10))
    opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
    # conv fp16, BN fp32
    assert {p.dtype for p in policy.model_params} == {torch.float16, torch.float32}
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(
        torch, "_foreach_copy_", lambda dst, src: (calls.append((dst, src)), real(dst, src))[1]
    )
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    loss = nn.functional.cross_entropy(model(policy.cast_input(x)).float(), y)
    assert backward_and_step(loss, policy, opt) is False
    assert len(calls) == 2 and all(len({t.dtype for t in dst}) == 1 for dst, _ in calls)
    # every weight = its master in its dtype
    for p, master in zip(policy.model_params, policy.master_params):
        assert torch.equal(p, master.to(p.dtype))


def test_the_loss_scale_is_followed_on_the_host_as_gradscaler_moves_it():
    cfg = PrecisionConfig(
        name="amp",
        autocast_dtype="bfloat16",
        loss_scale="dynamic",
        init_scale=8.0,
        growth_interval=2,
    )
    policy = PrecisionPolicy(cfg, torch.device("cpu"))
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(policy.optimizer_params(nn.ParameterList([w])), lr=0.1)
    skipped = []
    for bad in [False, False, True, False, True, True, False, False, False]:
        loss = (w * (float("inf") if bad else 1.0)).sum()
        skipped.append(backward_and_step(loss, policy, opt))
        opt.zero_grad()
        # GradScaler's own value (a sync: the test only)
        assert policy.scale_value == policy.scaler.get_scale()
    assert skipped == [False, False, True, False, True, True, False, False, False]
    # grew after 2 good steps; halved per overflow; grew
    assert policy.scale_value == 8.0 * 2 / 2 / 2 / 2 * 2


def test_batches_have_the_configured_layout_and_ghost_bn_keeps_it():
    images = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    for channels_last in (False, True):
        batches = data.DeviceBatches(
            images,
            torch.arange(8),
            4,
            (0.5,) * 3,
            (0.25,) * 3,
            device=torch.device("cpu"),
            train=True,
            crop_padding=2,
            flip=True,
            channels_last=channels_last,
        )
        x, _ = next(iter(batches))
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=fmt) and x.is_contiguous() != channels_last
    torch.manual_seed(0)
    nchw, nhwc = GhostBatchNorm(4, 2), GhostBatchNorm(4, 2)
    with torch.no_grad():
        nchw.weight.uniform_(), nchw.bias.uniform_()
    nhwc.load_state_dict(nchw.state_dict())
    x = torch.randn(8, 4, 5, 5) * 3 + 1
    a, b = (
        x.clone().requires_grad_(),
        x.contiguous(memory_format=torch.channels_last).requires_grad_(),
    )
    # Page's reshape + F.batch_norm, and the per-split statistics of channels_last
    ya, yb = nchw(a), nhwc(b)
    assert (
        ya.is_contiguous()
        and yb.is_contiguous(memory_format=torch.channels_last)
        and not yb.is_contiguous()
    )
    torch.testing.assert_close(yb, ya)
    torch.testing.assert_close(nhwc.running_mean, nchw.running_mean)
    torch.testing.assert_close(nhwc.running_var, nchw.running_var)
    g = torch.randn_like(ya)
    ya.backward(g), yb.backward(g)
    torch.testing.assert_close(b.grad, a.grad)
    torch.testing.assert_close(nhwc.weight.grad, nchw.weight.grad)


def test_the_accelerator_rng_is_saved_and_restored_on_the_jobs_own_device(two_gpus, monkeypatch):
    saved, restored = [], []
    # this job/rank runs on cuda:1
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": saved.append(device) or torch.tensor([7])
    )
    monkeypatch.setattr(
        torch.cuda,
        "set_rng_state",
        lambda state, device="cuda": restored.append((state.item(), device)),
    )
    state = checkpoint.rng_state()
    checkpoint.set_rng_state(state)
    assert saved == [torch.device("cuda", 1)] and restored == [(7, torch.device("cuda", 1))]


def test_a_cpu_job_on_a_gpu_machine_leaves_cudas_rng_alone(two_gpus, monkeypatch, tmp_path):
    # Saving or restoring CUDA's RNG state initialises CUDA: a job that runs on the CPU has none to
    # keep.
    calls = []
    for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(
            torch.cuda, name, lambda *a, name=name, **k: calls.append(name) or torch.zeros(8)
        )
    # a checkpoint after epoch 1
    s = run_tiny(tmp_path / "job", "trainer.epochs=2", "trainer.max_steps=null")
    assert s["status"] == "completed" and s["env"]["device"] == "cpu", s.get("error")
    saver = checkpoint.Checkpointer(tmp_path, meta={"device_type": "cpu"})
    state = LoopState()
    saver.save(state)
    saver.restore(torch.load(tmp_path / checkpoint.CHECKPOINT, weights_only=False), state)
    assert calls == []
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    checkpoint.set_rng_state(checkpoint.rng_state("cuda"), "cuda")   # a CUDA job's are kept
    assert calls == ["get_rng_state", "set_rng_state"]


@pytest.mark.parametrize(
    "module, name",
    [
        ("test_gpt", "GPT_JOB"),
        ("test_pitfalls", "SMALL"),
        ("test_report", "SIZES"),
        ("helpers", "TINY"),
        ("test_lm", "LM"),
        ("test_probe", "LM"),
    ],
)
def test_the_tests_cpu_jobs_stay_on_the_cpu_of_a_gpu_machine(two_gpus, module, name):
    # what they assert is CPU behaviour (FP8 and fp16 emulated, fused kernels off):
    # trainer.device=auto would run them on the GPU there
    overrides = getattr(load_test_module(module), name)
    assert hardware.select_device(
        validate(compose_config(*overrides)).trainer.device
    ) == torch.device("cpu")


def test_arch_names_are_parsed_with_their_suffixes():
    names = ["sm_75", "sm_90a", "sm_100a", "sm_120", "compute_90"]
    assert [hardware.parse_arch(a) for a in names] == \
        [("sm", 75, ""), ("sm", 90, "a"), ("sm", 100, "a"), ("sm", 120, ""), ("compute", 90, "")]
    assert hardware.parse_arch("gfx90a") is None   # a ROCm name: not a CUDA arch
    assert hardware.has_kernels_for(names, (9, 0)) and hardware.has_kernels_for(names, (7, 5))
    # arch-specific: that GPU only
    assert not hardware.has_kernels_for(["sm_90a", "compute_90"], (8, 9))
    assert not hardware.has_kernels_for(["sm_90a"], (10, 0)) and hardware.has_kernels_for(
        ["sm_100a"], (10, 0)
    )
    assert hardware.has_kernels_for(["sm_100f"], (10, 3)) and not hardware.has_kernels_for(
        ["sm_100f"], (12, 0)
    )
    assert not hardware.has_kernels_for(["sm_120", "compute_120"], (9, 0))
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "hardware.has_kernels_for(arch, (major, minor))" in script and "int(a[3:])" not in script


CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]   # a CUDA 12.6 wheel's list


@pytest.mark.parametrize("arch, cap, runs", [
    (CU126, (9, 0), True), (CU126, (8, 9), True), (CU126, (7, 0), True),
    (CU126, (10, 0), False), (CU126, (12, 0), False),   # a B200, an RTX 5090: another major
    (["sm_80"], (9, 0), False), (["sm_80"], (8, 6), True), (["sm_86"], (8, 0), False),
    (["sm_80", "compute_80"], (9, 0), True),             # PTX: compiled for a later GPU
    (["compute_90"], (12, 0), True), (["compute_90"], (8, 9), False),
    (["compute_90a"], (9, 0), True), (["compute_90a"], (10, 0), False),   # arch-specific PTX too
    (["sm_90a"], (9, 0), True), (["sm_100a"], (10, 3), False),
    (["sm_100f"], (10, 0), True), (["sm_103f"], (10, 0), False), (["compute_100f"], (12, 0), False),
    (["sm_90x"], (9, 0), False), (["gfx90a"], (9, 0), False),
])
def test_kernels_count_for_their_major_version_and_ptx_for_later_gpus(arch, cap, runs):
    assert hardware.has_kernels_for(arch, cap) is runs


def test_fp32_weights_are_cpu_copies():
    config = validate(compose_config("precision=o2"))
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    model = policy.prepare_model(small_cnn(4, 10))
    policy.optimizer_params(model)
    state = policy.fp32_state_dict(model)
    live = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    for k, v in state.items():
        assert v.device == torch.device("cpu") and v.untyped_storage().data_ptr() not in live, k
        assert v.dtype == (torch.float32 if v.is_floating_point() else model.state_dict()[k].dtype)


@pytest.mark.parametrize(
    "cap, reason", [((9, 0), None), ((8, 0), "compute capability 8.0 < 8.9: no FP8 tensor cores")]
)
def test_fp8_asks_the_jobs_device_for_its_capability(two_gpus, monkeypatch, cap, reason):
    from mixprec.precision import fp8

    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or cap
    )
    assert fp8.emulation_reason(torch.device("cuda", 1)) == reason
    assert asked == [torch.device("cuda", 1)]


def test_the_reproduction_folder_names_every_visible_gpu(two_gpus, monkeypatch):
    from mixprec.tools.folder import environment

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"GPU number {i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: type("P", (), dict(
        name="GPU number 0", major=9, minor=0, total_memory=80 * 2**30))())
    env = environment()
    assert (
        env["gpus"] == ["GPU number 0", "GPU number 1"]
        and env["device"] == "cuda:0"
        and env["capability"] == "9.0"
    )


@pytest.mark.parametrize(
    "overrides, batch",
    [
        ([], 64),
        (["model=resnet18"], 64),  # a CPU: unchanged
        (["trainer.device=cuda", "model=resnet18"], 256),
        (["trainer.device=cuda:1", "model=resnet152"], 256),
        # language models
        (["trainer.device=cuda", "model=lstm"], 64),
        (["trainer.device=cuda", "model=gpt"], 64),
        # an override wins
        (["trainer.device=cuda", "model=resnet18", "trainer.batch_size=32"], 32),
        # the article's batch
        (["trainer.device=cuda", "experiment=fastai_cifar100"], 64),
        (["trainer.device=cuda", "experiment=torch_amp", "workload=resnet18_cifar10"], 256),
    ],
)
def test_the_default_batch_is_256_for_an_image_model_on_a_gpu(overrides, batch):
    assert validate(compose_config(*overrides)).trainer.batch_size == batch


def test_trainer_device_auto_gets_the_gpu_batch_where_cuda_is_visible(two_gpus):
    assert validate(compose_config("model=resnet18")).trainer.batch_size == 256
    assert validate(compose_config("model=resnet18", "trainer.device=cpu")).trainer.batch_size == 64


# ----------------------------------------------------------------- a CPU job's own memory peak

def test_a_cpu_jobs_peak_is_its_own_not_an_earlier_jobs(tmp_path, monkeypatch):
    """Two jobs in one process, as a sweep runs them: the first holds an extra 300 MB (touched), the
    second is tiny. The second's peak is its own, below the first's by most of the 300 MB (the
    process's ru_maxrss never falls: it would report the first job's), and it says what it
    measured."""

    build = mixprec.train.parts.build_model

    def with_buffer(cfg, n, **kw):
        model = build(cfg, n, **kw)
        model.register_buffer("ballast", torch.ones(300 * 2**20 // 4), persistent=False)
        return model

    monkeypatch.setattr(mixprec.train.parts, "build_model", with_buffer)
    big = run_tiny(tmp_path / "big")["metrics"]
    monkeypatch.setattr(mixprec.train.parts, "build_model", build)
    small = run_tiny(tmp_path / "small")["metrics"]
    assert small["peak_memory_mb"] < big["peak_memory_mb"] - 200, (big, small)
    assert small["peak_memory_kind"] == big["peak_memory_kind"] == "process_rss_since_job_start"


@pytest.mark.slow   # a subprocess sweep
def test_a_sweep_reports_each_cpu_jobs_own_peak(tmp_path):
    """A CPU sweep in one process (train.py -m): ResNet-18 on 32x32 images, then a small CNN
    (width 32). The RSS since the job's start still holds the heap glibc kept from ResNet-18 (in a
    fresh CI venv the small CNN read 1510 MB against 1558), so the column says so; each job's own
    bytes are the memory ledger's, the small CNN's far below ResNet-18's."""
    import json

    from helpers import run_cli

    r = run_cli("-m", "model=resnet18,small_cnn", "dataset.image_size=32",
                "dataset.train_size=64", "dataset.test_size=32", "trainer.batch_size=64",
                "trainer.eval_batch_size=32", "trainer.max_steps=1", "logger=none",
                "trainer.device=cpu", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    peak = {}
    for p in tmp_path.glob("*/summary.json"):
        s = json.loads(p.read_text())
        peak[s["choices"]["model"]] = s["memory"]["total_bytes"]
    assert peak["small_cnn"] < peak["resnet18"] / 5, peak
    assert "peak MB (RSS since job start, heap kept from earlier jobs included)" in r.stdout
