"""Weight-decay groups: which tensors decay, per model family (optimizer.decay), and what
summary.json records."""
import pytest
import torch

from helpers import TINY, compose_config, run_tiny
from mixprec.config import ConfigError, ModelConfig, OptimizerConfig, validate
from mixprec.models import build_model
from mixprec.train.optim import build_optimizer, decay_mode, param_groups


GPT_JOB = [
    "logger=none",
    "model=gpt",
    "dataset=synthetic_text",
    "dataset.vocab_size=64",
    "dataset.train_size=400",
    "dataset.test_size=100",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=16",
    "model.block_size=8",
    "dataset.bptt=8",
    "model.vocab_multiple=1",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=8",
    "optimizer=adamw",
    "optimizer.weight_decay=0.1",
    "schedule=constant",
    "trainer.max_steps=2",
    "trainer.device=cpu",
]


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
    assert (
        "wte.weight" in decayed
        and "wpe.weight" in decayed
        and "blocks.0.attn.c_attn.weight" in decayed
    )
    assert kept == {n for n, p in model.named_parameters() if p.dim() < 2}
    assert "ln_f.weight" in kept and "blocks.1.ln_1.bias" in kept and "blocks.0.mlp.0.bias" in kept
    assert not decayed & kept and len(decayed | kept) == len(list(model.parameters()))
    assert record["decay"] == "matrices"
    assert [(g["kind"], g["weight_decay"]) for g in record["groups"]] == [
        ("decay", 0.1),
        ("no_decay", 0.0),
    ]
    assert sorted(record["groups"][1]["names"]) == sorted(kept)
    opt = build_optimizer(OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1), groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_decay_all_is_one_group_and_the_default_of_the_other_families():
    _, groups, record = gpt_groups("all")
    assert (
        len(groups) == 1 and record["decay"] == "all" and record["groups"][0]["weight_decay"] == 0.1
    )
    assert decay_mode("auto", "gpt") == "matrices"
    assert all(decay_mode("auto", a) == "all" for a in ("resnet18", "resnet9", "small_cnn", "lstm"))
    assert decay_mode("matrices", "resnet18") == "matrices"


def test_matrices_is_an_option_for_every_model():
    cfg = validate(compose_config(*TINY, "optimizer.decay=matrices"))
    model = build_model(cfg.model, 10)
    params = list(model.parameters())
    groups, record = param_groups(model, params, params, cfg.optimizer, cfg.model.arch)
    assert {p.dim() >= 2 for p in groups[0]["params"]} == {True} and {
        p.dim() for p in groups[1]["params"]
    } == {1}
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
    assert (
        "ln_f.weight" in groups[1]["names"]
        and sum(g["numel"] for g in groups) == s["metrics"]["params"]
    )


def test_an_image_job_records_one_decayed_group(tmp_path):
    s = run_tiny(tmp_path)
    assert s["optimizer"]["decay"] == "all" and len(s["optimizer"]["groups"]) == 1


def sgd_after_a_skipped_first_step(
    impl: str, nesterov: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and momentum buffer of SGD (optimizer.impl=impl) after a first step GradScaler skips
    (an inf gradient) and a second with gradient 1 everywhere, on the CPU."""
    w = torch.nn.Parameter(torch.ones(64))
    cfg = OptimizerConfig(
        name="sgd", lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=1e-3, impl=impl
    )
    opt = build_optimizer(cfg, [w])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for g in (float("inf"), 1.0):
        opt.zero_grad()
        scaler.scale((w * torch.tensor(g)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 15                     # the first step was skipped
    return w.detach().clone(), opt.state[w]["momentum_buffer"].clone()


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_after_a_skipped_first_step_steps_as_foreach(nesterov):
    # torch's _fused_sgd allocates its momentum buffers with empty_like and fills them on the first
    # step only: a skipped first step left garbage that the second step used as momentum (0.89944
    # instead of 0.9).
    w, buf = sgd_after_a_skipped_first_step("fused", nesterov)
    w_ref, buf_ref = sgd_after_a_skipped_first_step("foreach", nesterov)
    # the one real step's gradient, weight decay included
    assert torch.equal(buf_ref, torch.full((64,), 1.001))
    assert torch.equal(w, w_ref) and torch.equal(buf, buf_ref)


def test_fused_sgd_from_zeroed_buffers_is_bitwise_the_first_step_kernel():
    torch.manual_seed(0)
    grads = [torch.randn(257) for _ in range(3)]
    out = []
    for impl in ("fused", "foreach"):
        w = torch.nn.Parameter(torch.linspace(-2, 2, 257))
        opt = build_optimizer(
            OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4, impl=impl), [w]
        )
        for g in grads:
            w.grad = g.clone()
            opt.step()
        out.append((w.detach().clone(), opt.state[w]["momentum_buffer"].clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
