#!/usr/bin/env bash
# The first thing to run on a GPU machine (a user's, or any we get): the environment, the GPU tests, then one short
# job per precision mode, ending with the sweep's table. Exit status: 2 when no GPU is visible (or its kernels are
# missing), 1 when the environment check itself failed (a bug), a GPU test failed or a job did not complete.
# Usage: scripts/gpu_check.sh [extra train.py overrides, e.g. gpu=h100]
#   scripts/gpu_check.sh --speed [--dry-run] [--out DIR] [overrides]: the 8-minute speed check instead
#   (scripts/gpu_speed.py: fp8 against amp_bf16 at width 4096 compiled, the ResNet speed table eager and compiled,
#   Page's step 10 eager and under reduce-overhead, the GPT in fp32/amp_bf16/fp8)
set -u
cd "$(dirname "$0")/.."
export WANDB_MODE=offline WANDB_SILENT=true PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--speed" ]; then
    shift
    exec python scripts/gpu_speed.py "$@"
fi

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>/dev/null || echo "nvidia-smi: not found"
python - <<'PY'
import sys

try:
    import hydra, torch   # noqa: F401  (hydra: the tests and the sweep below need it)
except ModuleNotFoundError as e:   # exit 3: not this machine's GPU, nor a bug: the wrong python
    print(f"gpu_check: {sys.executable} has no {e.name}: run it in the environment the README's "
          "set-up makes (. .venv/bin/activate)", file=sys.stderr)
    sys.exit(3)
from mixprec.runtime import hardware
device = hardware.select_device("auto")
env = hardware.describe(device)
print(f"torch {env['torch']}  CUDA {env['cuda']}  cuDNN {env['cudnn']}  python {env['python']}")
print(f"device {env['device']}: {env['device_name']}, capability {env['capability']}, {env['gpu_memory_gb']} GB")
if device.type == "cpu":   # exit 2: nothing to check (1: this block failed, a bug)
    print("gpu_check: no GPU is visible (torch.accelerator); nothing to check", file=sys.stderr)
    sys.exit(2)
arch = torch.cuda.get_arch_list()   # CUDA-only (docs/gpus.md: CUDA-only branches): the kernels this wheel carries
major, minor = map(int, env["capability"].split("."))
print(f"wheel kernels {arch}")
if not hardware.has_kernels_for(arch, (major, minor)):   # sm_90a, sm_100f and compute_90 parsed too
    print(f"gpu_check: this torch build has no kernels for sm_{major}{minor}; see docs/gpus.md (older GPUs)",
          file=sys.stderr)
    sys.exit(2)
PY
rc=$?
if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 2 ] || [ "$rc" -eq 3 ] || echo "gpu_check: the environment check itself failed (exit $rc, above): a bug, not a missing GPU" >&2
    [ "$rc" -eq 3 ] && exit 1
    exit "$rc"
fi

echo "== pytest -m gpu"   # every gpu-marked test of tests/ (tests/tools/test_gpu_speed.py checks none is left out)
python -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/
tests=$?

echo "== one short job per precision mode"
sweep="outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)"
python train.py -m precision=fp32,tf32,amp,amp_bf16,half,bf16,o1,o2,o3 model=resnet18 dataset=synthetic \
    trainer.batch_size=256 trainer.epochs=4 trainer.warmup_steps=8 logger=none "hydra.sweep.dir=$sweep" "$@"
jobs=$?
python - "$sweep" <<'PY'
import json, sys
from pathlib import Path
bad = [p.parent.name for p in Path(sys.argv[1]).glob("*/summary.json") if json.loads(p.read_text())["status"] == "failed"]
print(f"gpu_check: {len(bad)} job(s) failed: {', '.join(bad)}" if bad else "gpu_check: no job failed (a diverged fp16 job is a result, not a fault)")
PY
echo "gpu_check: pytest -m gpu exit $tests, sweep exit $jobs; records in $sweep"
[ "$tests" -eq 0 ] && [ "$jobs" -eq 0 ]
