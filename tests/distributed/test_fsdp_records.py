"""A sharded job's records: summary.json's strategy, world size, param/reduce dtypes and per-rank
held bytes (so the 1/N of sharding shows), the sweep table's columns for them, the report's FSDP
section, and experiment=fsdp_precision run under torchrun on 2 gloo ranks."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, compose_config, run_tiny
from helpers.compiling import traced_only
from helpers.configs import GPT_TINY, sweep_params
from helpers.distributed import assert_one_rank_fsdp_job, free_port, job, whole_bytes
from mixprec.config import ConfigError, validate
from mixprec.train.parts import JobContext, wrapper
from mixprec.models import build_model
from mixprec.report.analyse import fsdp_rows, sweep_rows
from mixprec.report.console import format_table
from mixprec.report.render import Doc, fsdp_section
from mixprec.runtime import dist
from mixprec.train import checkpoint
from mixprec.train.build import build_trained

CPU = torch.device("cpu")
ADAMW = ["optimizer=adamw", "optimizer.lr=3e-3", "trainer.max_steps=4"]


@pytest.mark.slow   # a 2-rank torchrun job (about 19 s); quick: test_fsdp.py's 2-rank GPT job
def test_summary_says_strategy_dtypes_and_each_ranks_held_bytes(tmp_path):
    """2 ranks, fp32 reducing in bfloat16: summary.json's distributed block names the strategy,
    world size and dtypes, and lists per rank half of one process's bytes of parameters (the
    shards, not the root's parameters all-gathered after the last evaluation), gradients (measured
    before the step: present) and optimizer state; a 1-rank FSDP job holds all of them. The sweep
    table shows both in its strategy and MB/rank columns. The final fp32 weights load into the
    unsharded GPT in a plain process."""
    two = job([*GPT_TINY, *ADAMW, "trainer.strategy=fsdp", "precision.reduce_dtype=bfloat16"],
              tmp_path / "two", tmp_path)
    d = two["distributed"]
    assert (d["strategy"], d["world_size"], d["param_dtype"], d["reduce_dtype"]) == \
        ("fsdp", 2, "float32", "bfloat16")
    half = {k: v // 2 for k, v in whole_bytes().items()}
    assert d["held_bytes"] == [half, half]
    one = run_tiny(tmp_path / "one", *ADAMW, "trainer.strategy=fsdp", base=GPT_TINY)
    # the checks of the gpu test's 1-GPU FSDP job per mode (tests/distributed/test_fsdp.py), on the
    # CPU
    assert_one_rank_fsdp_job(one, tmp_path / "one", "fp32", "cpu")
    plain = run_tiny(tmp_path / "plain", *ADAMW, base=GPT_TINY)
    assert "distributed" not in plain   # a single-process record is unchanged
    table = format_table(sweep_rows([two, one, plain]))
    head, _, *lines = table.splitlines()
    assert "strategy" in head and "MB/rank p+g+o" in head.split("strategy")[1].split("peak MB")[0]
    mb = lambda b: "+".join(f"{b[k] / 2**20:.3g}" for k in ("params", "grads", "optimizer"))  # noqa: E731
    assert "fsdp x2 float32/reduce bfloat16" in lines[0] and mb(half) in lines[0]
    assert "fsdp x1 float32/reduce float32" in lines[1] and mb(whole_bytes()) in lines[1]
    assert "fsdp" not in lines[2]
    assert "strategy" not in format_table(sweep_rows([plain]))   # no sharded job: as before
    model, _ = checkpoint.load_fp32_model(tmp_path / "two")   # evaluate.py's loader, one process
    saved = torch.load(tmp_path / "two" / "model_fp32.pt", weights_only=True)
    assert all(type(v) is torch.Tensor and torch.equal(v, saved[k])
               for k, v in model.state_dict().items())


def _summary(reduce, loss, seconds, world=2, job=0):
    return {"status": "completed", "job": {"num": job},
            "config": {"precision": {"name": "amp_bf16", "reduce_dtype": reduce},
                       "model": {"arch": "gpt"}, "trainer": {"strategy": "fsdp"}},
            "choices": {"precision": "amp_bf16", "model": "gpt"},
            "metrics": {"final_valid_loss": loss, "train_time_s": seconds},
            "distributed": {"strategy": "fsdp", "world_size": world, "param_dtype": "bfloat16",
                            "reduce_dtype": reduce or "float32",
                            "held_bytes": [{"params": 2**20, "grads": 2**20,
                                            "optimizer": 2**21}] * world}}


def test_report_section_sets_bf16_reduction_against_its_fp32_twin():
    """The report's FSDP rows: the bfloat16-reduce job against the job that differs only in
    reduce_dtype (loss difference, time ratio; none for that twin itself), a job of another world
    size against none."""
    rows = fsdp_rows([_summary("bfloat16", 3.5, 8.0, job=1), _summary(None, 3.25, 10.0),
                      _summary("bfloat16", 3.0, 1.0, world=4, job=2)])
    by_job = {r["job"]: r for r in rows}
    assert by_job[1]["dloss"] == 0.25 and by_job[1]["time_ratio"] == 0.8
    assert by_job[0]["dloss"] is None and by_job[0]["strategy"].endswith("reduce float32")
    assert by_job[2]["dloss"] is None and by_job[2]["held_mb"] == "1+1+2"
    d = Doc()
    fsdp_section(d, rows)
    assert any("bf16 against fp32 gradient reduction" in str(b) for b in d.blocks)
    table = [b for b in d.blocks if b[0] == "table"][0]
    assert "dloss vs fp32 reduce" in table[1] and "+0.25" in [c for r in table[2] for c in r]


def test_the_time_ratio_is_the_steady_one_where_both_jobs_have_it():
    """The float32-reduce job ran first and paid the process's one-time costs in its warm-up
    steps (train time 10 s against 8 s) while both trained at the same steady rate: the ratio is
    the steady throughput's (1.0), not the train times' (0.8); without a steady throughput the
    train times' ratio stays."""
    steady = {"throughput": 500.0, "throughput_includes_warmup": False}
    first, twin = _summary(None, 3.25, 10.0), _summary("bfloat16", 3.5, 8.0, job=1)
    first["metrics"].update(steady)
    twin["metrics"].update(steady, throughput=400.0)
    assert {r["job"]: r["time_ratio"] for r in fsdp_rows([twin, first])}[1] == 1.25
    twin["metrics"]["throughput"] = 500.0
    assert {r["job"]: r["time_ratio"] for r in fsdp_rows([twin, first])}[1] == 1.0
    twin["metrics"]["throughput_includes_warmup"] = True
    assert {r["job"]: r["time_ratio"] for r in fsdp_rows([twin, first])}[1] == 0.8


def test_the_fsdp_precision_preset_compiles_every_job():
    """experiment=fsdp_precision compiles its jobs: trainer.compile=default in every cell of its
    sweep (precision x reduce dtype; none sets compile otherwise, none refuses it under FSDP), and
    FSDP takes no prewarm steps."""
    params = sweep_params("fsdp_precision")
    assert not [k for k in params if "compile" in k]
    for precision in params["precision"].split(","):
        for reduce in params["precision.reduce_dtype"].split(","):
            config = validate(compose_config("experiment=fsdp_precision", f"precision={precision}",
                                             f"precision.reduce_dtype={reduce}"))
            assert config.trainer.compile == "default" and config.trainer.sharded
            assert config.trainer.prewarm_for("cpu") == config.trainer.prewarm_for("cuda") == 0


@pytest.mark.slow
def test_the_fsdp_precision_presets_fp8_job_compiles_before_the_clock(tmp_path, monkeypatch):
    """The preset's fp8 job reducing in bfloat16, tiny, on one FSDP rank, as the preset composes
    it (dynamo's eager backend; about 15 s of tracing through FSDP's hooks on this CPU): every
    graph is compiled in the warm-up before the clock, none in the timed steps and evaluations, no
    call runs eagerly, and no prewarm step is taken."""
    torch._dynamo.reset()
    made = traced_only(monkeypatch)
    tiny = [o for o in GPT_TINY if not o.startswith("trainer.max_steps")]
    s = run_tiny(tmp_path, "experiment=fsdp_precision", "hydra.mode=RUN", "precision=fp8",
                 "precision.reduce_dtype=bfloat16", "trainer.max_steps=4", base=tiny)
    assert s["status"] == "completed", s.get("error")
    assert s["config"]["trainer"]["compile"] == "default"
    assert s["fp8"]["fsdp_float8_all_gather"] is True
    m = s["metrics"]
    assert m["compile_time_s"] > 0 and made == [0] and m["prewarm_time_s"] == 0
    assert m["compiled_graphs"] >= 1 and m["eager_calls"] == 0


@pytest.mark.slow
def test_the_fsdp_precision_preset_sweeps_under_torchrun(tmp_path):
    """torchrun --nproc_per_node=2 train.py experiment=fsdp_precision at a tiny size: the six jobs
    (fp32, amp_bf16, fp8 x float32, bfloat16 reduction) complete on 2 gloo ranks in one sweep dir,
    the fp8 jobs all-gather in float8, and the sweep's report has the FSDP section. Run eagerly
    (trainer.compile=none): inductor on the six cells took about 4 minutes of a 2-core CPU; that
    the preset compiles is test_the_fsdp_precision_preset_compiles_every_job's, that its fp8 job
    compiles before the clock the next test's, and the compiled fp8 GPT on 2 ranks
    test_fsdp.py::test_fp8_all_gather_gpt_compiled_on_two_ranks's."""
    tiny = [o for o in GPT_TINY if not o.startswith(("logger", "trainer.max_steps"))]
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("MIXPREC_RUN_TIME", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(ROOT / "train.py"),
                        "experiment=fsdp_precision", *tiny, "trainer.max_steps=10",
                        "logger=none", "schedule=constant", "optimizer.lr=3e-3",
                        "trainer.compile=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/summary.json")]
    assert len(summaries) == 6 and all(s["status"] == "completed" for s in summaries)
    cells = {(s["choices"]["precision"], s["distributed"]["reduce_dtype"]) for s in summaries}
    assert cells == {(p, d) for p in ("fp32", "amp_bf16", "fp8") for d in ("float32", "bfloat16")}
    assert all(s["fp8"]["fsdp_float8_all_gather"] for s in summaries
               if s["choices"]["precision"] == "fp8")
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "Sharded jobs (FSDP): bf16 against fp32 gradient reduction" in report
    assert "MB/rank p+g+o" in r.stdout


MODES = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))


@pytest.mark.parametrize("strategy", [pytest.param("auto", marks=pytest.mark.slow), "fsdp"])
def test_saved_weights_are_plain_fp32_tensors_in_every_mode_and_strategy(tmp_path, strategy):
    """model_fp32.pt of every precision mode the strategy takes (the GPT, as built for a job: the
    policy's weights, float8 Linear layers, FSDP's shards) loads with torch.load(weights_only=True),
    as scripts/generate.py and evaluate.py load it, every value a plain fp32 torch.Tensor, into the
    unsharded GPT. An FSDP fp8 job's weights were torchao's float8 weight subclass
    (WeightWithDynamicFloat8CastTensor), which weights_only refuses to unpickle. FSDP's weights are
    its fp32 shards gathered: the built model's weights exactly."""
    made = dist.init(dist.SINGLE, sharded=strategy == "fsdp")
    saved = []
    try:
        for mode in MODES:
            try:
                config = validate(compose_config(*GPT_TINY, f"precision={mode}",
                                                 f"trainer.strategy={strategy}"))
            except ConfigError:
                continue   # a mode FSDP cannot express (half, bf16, o3, apex_fp16_2018, mxfp8)
            torch.manual_seed(0)
            model = build_model(config.model, 64)
            initial = {k: v.clone() for k, v in model.state_dict().items()}
            built = build_trained(model, config, CPU,
                                  wrap=wrapper(JobContext(config, CPU, dist.SINGLE)))
            checkpoint.save_weights(tmp_path / mode, built.policy.fp32_state_dict(built.model), 64)
            weights = torch.load(tmp_path / mode / checkpoint.WEIGHTS, weights_only=True)
            assert {type(v) for v in weights.values()} == {torch.Tensor}, mode
            assert {v.dtype for v in weights.values()} == {torch.float32}, mode
            build_model(config.model, 64).load_state_dict(weights)
            if strategy == "fsdp":
                assert all(torch.equal(weights[k], v) for k, v in initial.items()), mode
            saved.append(mode)
    finally:
        dist.close(made)
    assert "fp8" in saved and len(saved) == (len(MODES) if strategy == "auto" else len(MODES) - 5)


@pytest.mark.parametrize("optimizer", ["adamw8bit",
                                       pytest.param("adamw4bit", marks=pytest.mark.slow)])
def test_a_low_bit_optimizers_state_is_held_at_its_quantized_size_under_fsdp(tmp_path, optimizer):
    """What each rank holds of torchao's quantized moments: their codes and block scales, as the
    ledger counts them (one rank: the whole state), not numel() x 4 bytes of the fp32 moments
    they stand for (which gave 8 bytes a parameter, fp32 AdamW's)."""
    s = run_tiny(tmp_path, *GPT_TINY, "trainer.strategy=fsdp", f"optimizer={optimizer}",
                 "model.n_embd=64", "precision=amp_bf16", "precision.emulate=false",
                 "trainer.max_steps=2", base=[])
    assert s["status"] == "completed", s.get("error")
    held = s["distributed"]["held_bytes"][0]
    ledger = s["memory"]["bytes"]["optimizer"]
    assert held["optimizer"] == pytest.approx(ledger, rel=1e-3)   # the ledger counts step scalars
    assert held["optimizer"] < 0.35 * 2 * held["params"]   # fp32 AdamW: 2 x the fp32 params


def test_a_sharded_image_job_says_its_batchnorm_weights_are_gathered_rounded(tmp_path):
    """FSDP's BatchNorms compute in fp32 but their weight and bias are gathered with their unit,
    in its dtype (precision/fsdp.py): the record says so, where one process keeps them fp32."""
    s = run_tiny(tmp_path, "trainer.strategy=fsdp", "precision=amp_bf16",
                 "precision.emulate=false")
    assert s["status"] == "completed", s.get("error")
    assert s["distributed"]["batchnorm"] == (
        "fp32 compute and running statistics; weight and bias gathered in bfloat16 with their "
        "unit (rounded), then read in fp32")
