"""Hardware: pick the device, set the math flags (TF32, cudnn.benchmark, determinism), describe the
machine, and match the chosen GPU profile against the GPU that is really there."""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import random
import re
import resource
import subprocess
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from ..config import ConfigError, GpuConfig, TrainerConfig
from .versions import installed

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[3]


# a sweep's jobs share one process: the first pays lazy CUDA init and cold autotuning caches
JOBS_IN_PROCESS = 0
# the values torch.use_deterministic_algorithms accepts for cuBLAS
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def select_device(name: str, option: str = "trainer.device") -> torch.device:
    """The job's device, always with an index on an accelerator (set_device refuses a device without
    one: torch/accelerator/_utils.py:25 and torch/_utils.py:920, "Expected a torch.device with a
    specified index"). auto: the build's accelerator (torch.accelerator) when one is visible, else
    the CPU. `option`: how the user chose it (a script's `--device`), for the error message."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        acc = torch.accelerator.current_accelerator(check_available=True)
        if acc is None:
            return torch.device("cpu")
        name = acc.type
    try:
        device = torch.device(name)
    except RuntimeError:   # not a device string at all
        raise ConfigError(f"{option}={name}: not a device; use auto, cpu, cuda or cuda:N") from None
    module = torch.get_device_module(device)
    if not module.is_available():
        raise ConfigError(f"{option}={name}: no {device.type.upper()} device is visible here; use "
                          f"{option}=auto or cpu")
    index = 0 if device.index is None else device.index
    if index >= module.device_count():
        raise ConfigError(
            f"{option}={name}: only {module.device_count()} {device.type} device(s) visible "
            f"(cuda:0..cuda:{module.device_count() - 1}); CUDA_VISIBLE_DEVICES chooses which"
        )
    return torch.device(device.type, index)


def configure(device: torch.device, trainer: TrainerConfig, seed: int) -> list[str]:
    """Seed every RNG and set the global math flags the trainer config asks for (the precision's are
    precision.modes.configure's); make `device` the current device and start its memory peak.
    Returns notes on what this device cannot honour."""
    global JOBS_IN_PROCESS
    JOBS_IN_PROCESS += 1
    notes = []
    if trainer.deterministic:
        notes += _cublas_deterministic(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = trainer.cudnn_benchmark and not trainer.deterministic
    torch.backends.cudnn.deterministic = trainer.deterministic
    random.seed(seed)
    # every device's generator (torch/random.py manual_seed seeds cuda too)
    torch.manual_seed(seed)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device)
    reset_memory_peak(device)
    _MEMORY[device] = None
    return notes


def _cublas_deterministic(device: torch.device) -> list[str]:
    """Deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA initialises in this
    process ("CUDA only checks the variable when the runtime initializes":
    torch/testing/_internal/common_utils.py:2746). Set it while that is still ahead; once CUDA runs
    (an earlier job of a sweep), say that it is too late. The variable stays set: the workspace it
    configured stays in use for the rest of the process."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") in CUBLAS_DETERMINISTIC:
        return []
    # CUDA-only branch (docs/gpus.md; tests/gpu/test_gpu.py)
    if device.type == "cuda" and torch.cuda.is_initialized():
        return [
            "trainer.deterministic=true: CUDA was initialised earlier in this process without "
            "CUBLAS_WORKSPACE_CONFIG, so cuBLAS GEMMs may not be deterministic; start the process "
            "with CUBLAS_WORKSPACE_CONFIG=:4096:8 (e.g. before a sweep)"
        ]
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    return []


def capability(device: torch.device) -> tuple[int, int] | None:
    """The accelerator's compute capability (major, minor); None on a CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device).get_device_capability(device)


# torch.cuda.get_arch_list(): sm_90, sm_90a, sm_100f, compute_90
ARCH = re.compile(r"(sm|compute)_(\d+)([a-z]?)")


def parse_arch(name: str) -> tuple[str, int, str] | None:
    """'sm_90a' -> ('sm', 90, 'a'): kind (sm: compiled kernels; compute: PTX), number (10 * major +
    minor), suffix ('a': arch-specific, that GPU only; 'f': that family). None for a name of another
    form."""
    m = ARCH.fullmatch(name)
    return None if m is None else (m[1], int(m[2]), m[3])


def runs_on(kind: str, n: int, suffix: str, cap: tuple[int, int]) -> bool:
    """Whether code built for one parsed arch (parse_arch) runs on a GPU of compute capability
    `cap`. CUDA's compatibility rules: a cubin (sm_N) runs on the same major version at a minor
    version >= its own, never across majors (sm_80 on an H100, sm_90 on a B200: no); PTX
    (compute_N) is compiled by the driver for any GPU numbered >= N, later majors included; an
    arch-specific build ('a', either kind) runs on exactly that capability; a family build ('f',
    either kind) on the same major version at a minor >= its own. Another suffix: not known to
    run."""
    number = 10 * cap[0] + cap[1]
    if suffix == "a":
        return n == number
    if suffix not in ("", "f"):
        return False
    if kind == "compute" and suffix == "":
        return n <= number
    return n // 10 == cap[0] and n <= number


def has_kernels_for(arch_list: list[str], cap: tuple[int, int]) -> bool:
    """Whether a wheel's arch list (torch.cuda.get_arch_list()) has code a GPU of compute
    capability `cap` can run (runs_on: cubins of its major version, PTX up to its number)."""
    return any(runs_on(*arch, cap) for arch in filter(None, map(parse_arch, arch_list)))


def fork_rng(device: torch.device):
    """torch.random.fork_rng for the CPU's generator and, on an accelerator, that device's (CUDA or
    another): what runs inside leaves both generators as they were."""
    if device.type == "cpu":   # the CPU's generator is always forked; no accelerator's
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# -- memory: the job's peak, and the steady-state training peak ------------------------------------
_MEMORY: dict = {}   # device -> the peak before the steady-state mark (None until the mark)


def mark_steady(device: torch.device) -> None:
    """Start the steady-state memory peak (where the warm-up steps end): what came before (the
    resident dataset, cuDNN autotuning workspaces, the first steps' allocator growth) is kept aside.
    No sync needed: the caching allocator counts on the host, when work is queued."""
    if device.type != "cpu":
        _MEMORY[device] = torch.accelerator.max_memory_allocated(device)
        torch.accelerator.reset_peak_memory_stats(device)


def reset_memory_peak(device: torch.device) -> None:
    """Start the device's memory peak afresh: the accelerator's peak of allocated bytes, or on a CPU
    the process's peak RSS (Linux: writing 5 to /proc/self/clear_refs sets VmHWM to the RSS of now;
    ru_maxrss never falls, so a sweep's jobs in one process would each report the largest job's
    peak so far). Where the kernel offers no reset the CPU's peak stays the process's."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _RSS_RESET[0] = True
    except OSError:
        _RSS_RESET[0] = False


# whether the CPU's peak RSS was reset at this job's start (reset_memory_peak)
_RSS_RESET = [False]
CPU_PEAK_KINDS = {
    # the RSS at the start holds what the allocator kept of earlier jobs: the ledger is the own part
    "process_rss_since_job_start": "RSS since job start, heap kept from earlier jobs included",
    "process_peak_rss": "process RSS, earlier jobs of the process included",
}


def rss_peak_mb() -> float:
    """The CPU process's peak RSS in MB: VmHWM (since the last reset_memory_peak) where the kernel
    has it, else ru_maxrss (since the process started)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_metrics(device: torch.device) -> dict:
    """peak_memory_mb: the job's peak since configure() (dataset, autotuning, training, evaluation;
    prewarm's throwaway copies are left out: reset_memory_peak after them); peak_memory_steady_mb:
    the peak after the warm-up steps (training and evaluation; None without a mark or on a CPU);
    peak_memory_kind: what was measured (max allocated by tensors on the device; on a CPU the
    process's RSS since the job's start, or since the process's start where it cannot be reset:
    CPU_PEAK_KINDS)."""
    if device.type == "cpu":
        kind = "process_rss_since_job_start" if _RSS_RESET[0] else "process_peak_rss"
        return {"peak_memory_mb": rss_peak_mb(), "peak_memory_steady_mb": None,
                "peak_memory_kind": kind}
    now = torch.accelerator.max_memory_allocated(device) / 2**20
    before = _MEMORY.get(device)
    return {"peak_memory_mb": now if before is None else max(now, before / 2**20),
            "peak_memory_steady_mb": None if before is None else now,
            "peak_memory_kind": f"{device.type}_max_allocated"}


def describe(device: torch.device) -> dict:
    """What ran the job: versions, device, math flags, commit."""
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "capability": None,
        "gpu_memory_gb": None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch_threads": torch.get_num_threads(),
        # 1: the process's first job (lazy init and autotuning in its warm-up)
        "job_in_process": JOBS_IN_PROCESS,
    }
    if device.type != "cpu":
        props = torch.get_device_module(device).get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gb=round(props.total_memory / 2**30, 1))
    env["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    # the key packages; the report flags those that differ from constraints.txt
    env["versions"] = installed()
    env.update(git_state())
    return env


def git_state() -> dict:
    def git(*args):
        try:
            out = subprocess.run(
                ["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10
            )
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if dirty is None else bool(dirty)}


def gpu_profile(gpu: GpuConfig, device_name: str) -> dict:
    """The profile to use for MFU, or why none is used. A profile matches a device by its full name
    as the driver reports it (get_device_properties(...).name: "NVIDIA H100 80GB HBM3" is the SXM
    card, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" are not), case and surrounding spaces aside; one
    that does not match is reported (matched: false) and its peaks are not used. gpu=auto uses the
    profile of conf/gpu/ that matches the device (device_name "cpu": a CPU job, no profile)."""
    if gpu.name == "auto":
        return auto_profile(device_name)
    names = list(gpu.match)
    matched = _matches(gpu, device_name)
    info = {
        "name": gpu.name,
        "matched": matched,
        "peak_tflops": dict(gpu.peak_tflops) if matched else None,
        "memory_gb": gpu.memory_gb,
        "bandwidth_gbs": gpu.bandwidth_gbs,
        "source": gpu.source,
    }
    if not matched:
        info["note"] = (
            f"gpu={gpu.name} is for devices named {' or '.join(repr(n) for n in names)} but this "
            f"job ran on '{device_name}': its peak numbers are not used (add the name to "
            f"conf/gpu/{gpu.name}.yaml only if it is the same card)"
        )
    return info


def _matches(gpu: GpuConfig, device_name: str) -> bool:
    return device_name.strip().lower() in {n.strip().lower() for n in gpu.match}


def known_profiles() -> list[GpuConfig]:
    """Every named GPU profile of conf/gpu/ (auto aside), in name order."""
    files = sorted(f for f in (PROJECT_ROOT / "conf" / "gpu").glob("*.yaml") if f.stem != "auto")
    return [GpuConfig(**OmegaConf.to_container(OmegaConf.load(f))) for f in files]


def auto_profile(device_name: str) -> dict:
    """gpu=auto: the named profile whose `match` holds this device's name (chosen_by: auto), or, for
    a GPU no profile knows, no peaks and a note saying how to add one (job.warn_if_slow logs it, one
    line)."""
    if device_name == "cpu":
        return {"name": "auto", "matched": None, "peak_tflops": None,
                "note": "a CPU job: no GPU profile, no MFU"}
    for gpu in known_profiles():
        if _matches(gpu, device_name):
            return {**gpu_profile(gpu, device_name), "chosen_by": "auto"}
    note = (
        f"gpu=auto: no profile in conf/gpu/ matches '{device_name}', so MFU is not shown; add a "
        "profile with its datasheet's dense peaks and this name in `match`"
    )
    return {"name": "auto", "matched": False, "peak_tflops": None, "note": note}


def mfu(metrics: dict, profile: dict, peak_kind: str, world: int = 1) -> float | None:
    """Model FLOP utilisation: 3 x forward FLOPs per sample x steady samples/s (global, all ranks)
    over `world` GPUs' dense peak for the precision's math (None without a matched profile or a
    known peak)."""
    peak = (profile.get("peak_tflops") or {}).get(peak_kind)
    flops = metrics.get("train_flops_per_sample")
    if not peak or not flops or not metrics.get("throughput"):
        return None
    return flops * metrics["throughput"] / (world * peak * 1e12)


def flatten_rnns(module: nn.Module) -> int:
    """Compact the weights of every nn.RNNBase in `module` into the one chunk cuDNN takes
    (flatten_parameters; a no-op off CUDA). A copy (prewarm's deepcopy), a checkpoint load that
    swaps the parameters (emulation) or a dtype change can leave them apart, and cuDNN then compacts
    them again at every call ("RNN module weights are not part of single contiguous chunk of
    memory"). Called after each of those; returns how many RNNs it saw."""
    rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
    for m in rnns:
        with _cudnn_dtype_accepted(m.all_weights[0][0]):
            m.flatten_parameters()
    return len(rnns)


@contextlib.contextmanager
def _cudnn_dtype_accepted(weight: torch.Tensor):
    """flatten_parameters takes only torch.backends.cudnn.CUDNN_TENSOR_DTYPES (fp32, fp16, fp64)
    while ATen's own test (torch.cudnn_is_acceptable, which decides whether the RNN runs cuDNN) may
    take bf16 too (no dtype test in recent torch): bf16 weights then ran cuDNN uncompacted. The
    weight's dtype is accepted for the call in that case only; if cuDNN cannot flatten it, a warning
    says so and the weights stay as they were."""
    dtypes = torch.backends.cudnn.CUDNN_TENSOR_DTYPES
    extra = (weight.is_cuda and weight.dtype not in dtypes and torch.cudnn_is_acceptable(weight))
    if extra:
        dtypes.add(weight.dtype)
    try:
        yield
    except RuntimeError as e:
        log.warning(
            f"mixprec: cuDNN could not compact the {weight.dtype} RNN weights "
            f"({str(e).splitlines()[0]}); it copies them at every call"
        )
    finally:
        if extra:
            dtypes.discard(weight.dtype)
