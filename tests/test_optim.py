"""Weight-decay groups: which tensors decay, per model family (optimizer.decay), and what summary.json records."""
import pytest
import torch

from helpers import TINY, compose_config, run_tiny
from mixprec.config import ConfigError, ModelConfig, OptimizerConfig, validate
from mixprec.models import build_model
from mixprec.optim import build_optimizer, decay_mode, param_groups


GPT_JOB = ["logger=none", "model=gpt", "dataset=synthetic_text", "dataset.vocab_size=64", "dataset.train_size=400",
           "dataset.test_size=100", "model.n_layer=2", "model.n_head=2", "model.n_embd=16", "model.block_size=8",
           "dataset.bptt=8", "model.vocab_multiple=1", "trainer.batch_size=4", "trainer.eval_batch_size=8",
           "optimizer=adamw", "optimizer.weight_decay=0.1", "schedule=constant", "trainer.max_steps=2",
           "trainer.device=cpu"]


def gpt_groups(decay="auto"):
    model = build_model(ModelConfig(arch="gpt", n_layer=2, n_head=2, n_embd=16, block_size=8), 64)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, decay=decay)
    return model, *param_groups(model, params, params, cfg, "gpt")


def test_the_gpt_decays_its_matmul_and_embedding_weights_only():
    model, groups, record = gpt_groups()
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in groups if g.get("weight_decay", 0.1) > 0 for p in g["params"]}
    kept = {names[id(p)] for g in groups if g.get("weight_decay", 0.1) == 0 for p in g["params"]}
    assert decayed == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert "wte.weight" in decayed and "wpe.weight" in decayed and "blocks.0.attn.c_attn.weight" in decayed
    assert kept == {n for n, p in model.named_parameters() if p.dim() < 2}
    assert "ln_f.weight" in kept and "blocks.1.ln_1.bias" in kept and "blocks.0.mlp.0.bias" in kept
    assert not decayed & kept and len(decayed | kept) == len(list(model.parameters()))
    assert record["decay"] == "matrices"
    assert [(g["kind"], g["weight_decay"]) for g in record["groups"]] == [("decay", 0.1), ("no_decay", 0.0)]
    assert sorted(record["groups"][1]["names"]) == sorted(kept)
    opt = build_optimizer(OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1), groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_decay_all_is_one_group_and_the_default_of_the_other_families():
    _, groups, record = gpt_groups("all")
    assert len(groups) == 1 and record["decay"] == "all" and record["groups"][0]["weight_decay"] == 0.1
    assert decay_mode("auto", "gpt") == "matrices"
    assert all(decay_mode("auto", a) == "all" for a in ("resnet18", "resnet9", "small_cnn", "lstm"))
    assert decay_mode("matrices", "resnet18") == "matrices"


def test_matrices_is_an_option_for_every_model():
    cfg = validate(compose_config(*TINY, "optimizer.decay=matrices"))
    model = build_model(cfg.model, 10)
    params = list(model.parameters())
    groups, record = param_groups(model, params, params, cfg.optimizer, cfg.model.arch)
    assert {p.dim() >= 2 for p in groups[0]["params"]} == {True} and {p.dim() for p in groups[1]["params"]} == {1}
    with pytest.raises(ConfigError, match="optimizer.decay='some'"):
        validate(compose_config(*TINY, "optimizer.decay=some"))


def test_master_weights_are_grouped_by_their_model_parameter():
    model = build_model(ModelConfig(arch="small_cnn", width=8), 10).half()
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    cfg = OptimizerConfig(name="sgd", weight_decay=5e-4, decay="matrices")
    groups, _ = param_groups(model, params, masters, cfg, "small_cnn")
    assert {p.dtype for g in groups for p in g["params"]} == {torch.float32}
    assert [p.dim() >= 2 for p in groups[0]["params"]] == [True] * len(groups[0]["params"])


def test_a_gpt_job_records_its_groups(tmp_path):
    s = run_tiny(tmp_path, base=GPT_JOB)
    assert s["status"] == "completed", s.get("error")
    groups = s["optimizer"]["groups"]
    assert s["optimizer"]["decay"] == "matrices"
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert "ln_f.weight" in groups[1]["names"] and sum(g["numel"] for g in groups) == s["metrics"]["params"]


def test_an_image_job_records_one_decayed_group(tmp_path):
    s = run_tiny(tmp_path)
    assert s["optimizer"]["decay"] == "all" and len(s["optimizer"]["groups"]) == 1
