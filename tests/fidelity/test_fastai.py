"""Fidelity to fastai 1.0.42's own code (the first part of the old tests/test_fidelity.py): its
settings -> mixprec's config keys, each with the source file and line, checked on the composed
preset; the behaviour behind the settings that are code (to_fp16, one-cycle, the head), each
against an independent implementation or a hand count; and every fastai published value's
`match` composed and checked against the settings its source ran. Source read: fastai 1.0.42
(git tag 1.0.42 of fastai/fastai1)."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from helpers import run_cli
from helpers.fidelity import check_table, composed
from mixprec.config import ConfigError
from mixprec.models import build_model
from mixprec.train.optim import build_optimizer, build_schedule
from mixprec.precision.policy import PrecisionPolicy, StaticScaler
from mixprec.report.published import PUBLISHED_DIR, load_source, matches


# ------------------------------------------------------------------------------------ fastai 1.0.42
FASTAI = ["experiment=fastai_cifar100", "model=resnet18", "precision=fastai_fp16"]
FASTAI_TABLE = [  # (config key, value, fastai 1.0.42 source of the setting)
    (
        "precision.param_dtype",
        "float16",
        "train.py:36 to_fp16: learn.model = model2half(learn.model)",
    ),
    ("precision.keep_bn_fp32", True, "torch_core.py:202-210 model2half = bn2float(model.half())"),
    (
        "precision.master_weights",
        True,
        "callbacks/fp16.py:10-28 get_master; :94-99 master2model after the step",
    ),
    ("precision.loss_scale", 512.0, "train.py:34 to_fp16(loss_scale=512.); callbacks/fp16.py:57"),
    (
        "precision.autocast_dtype",
        None,
        "callbacks/fp16.py: no autocast; fp16 model, output .float() at :79-81",
    ),
    ("model.head", "fastai", "vision/learner.py:43-53 create_head; :63 custom_head or create_head"),
    ("model.pretrained", True, "vision/learner.py:55 create_cnn(pretrained=True)"),
    ("model.freeze_body", True, "vision/learner.py:67 `if pretrained: learn.freeze()`"),
    ("optimizer.name", "adamw", "basic_train.py:137 opt_func=AdamW; :140 true_wd=True"),
    (
        "optimizer.betas",
        (0.9, 0.99),
        "torch_core.py:63 AdamW = partial(optim.Adam, betas=(0.9,0.99))",
    ),
    (
        "optimizer.eps",
        1e-8,
        "torch.optim.Adam's default eps, kept by the partial (torch_core.py:63)",
    ),
    ("optimizer.weight_decay", 1e-2, "basic_train.py:12 defaults.wd = 1e-2; :142 wd=defaults.wd"),
    (
        "optimizer.lr",
        3e-3,
        "basic_train.py:11 defaults.lr = slice(3e-3); train.py:14 max_lr=defaults.lr",
    ),
    ("schedule.name", "fastai_onecycle", "train.py:14-22 fit_one_cycle -> OneCycleScheduler"),
    ("schedule.div_factor", 25.0, "train.py:15 div_factor:float=25."),
    ("schedule.pct_start", 0.3, "train.py:15 pct_start:float=0.3"),
    ("schedule.moms", (0.95, 0.85), "train.py:15 moms=(0.95,0.85)"),
    ("schedule.final_div", 1e4, "callbacks/one_cycle.py:28 (self.lr_max, low_lr/1e4)"),
    ("trainer.batch_size", 64, "basic_data.py:108 DataBunch.create(bs:int=64)"),
]


def test_fastai_preset_is_fastai_1_0_42s_recipe():
    c, _ = composed(*FASTAI)
    check_table(c, FASTAI_TABLE)
    c, s = composed("experiment=fastai_cifar100")
    # a plain job of the preset
    assert c.model.arch == "resnet18" and s["choices"]["precision"] == "fp32"


def test_fastai_fp16_is_to_fp16_fp16_weights_fp32_bn_fp32_masters_static_512():
    c, _ = composed(
        *FASTAI, "model.pretrained=false", "dataset=synthetic", "dataset.num_classes=100"
    )
    policy = PrecisionPolicy(c.precision, torch.device("cpu"))
    model = policy.prepare_model(build_model(c.model, 100))
    for m in model.modules():
        for p in m.parameters(recurse=False):
            bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
            assert p.dtype == (torch.float32 if bn else torch.float16)
    masters = policy.optimizer_params(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(masters) == len(trainable) and all(m.dtype == torch.float32 for m in masters)
    assert isinstance(policy.scaler, StaticScaler) and policy.scaler.get_scale() == 512.0


def test_create_cnn_head_and_frozen_body_by_hand_count():
    c, _ = composed(*FASTAI, "model.pretrained=false")
    model = build_model(c.model, 100)
    body, head = model
    kinds = [type(m).__name__ for m in head]
    # create_head(nf=1024, nc=100): AdaptiveConcatPool2d, Flatten, bn_drop_lin(1024, 512, p=0.25,
    # ReLU), bn_drop_lin(512, 100, p=0.5) (learner.py:45-51; layers.py:48-54)
    assert kinds == [
        "AdaptiveConcatPool2d",
        "Flatten",
        "BatchNorm1d",
        "Dropout",
        "Linear",
        "ReLU",
        "BatchNorm1d",
        "Dropout",
        "Linear",
    ]
    assert (head[2].num_features, head[3].p, head[4].in_features, head[4].out_features) == (
        1024,
        0.25,
        1024,
        512,
    )
    assert (head[6].num_features, head[7].p, head[8].in_features, head[8].out_features) == (
        512,
        0.5,
        512,
        100,
    )
    assert [type(m).__name__ for m in body] == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"] + [
        "Sequential"
    ] * 4
    # freeze with train_bn=True: trainable = the whole head + every BatchNorm weight and bias of the
    # body
    bn_params = sum(2 * m.num_features for m in body.modules() if isinstance(m, nn.BatchNorm2d))
    head_params = (2 * 1024 + 1024 * 512 + 512) + (2 * 512 + 512 * 100 + 100)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == bn_params + head_params
    x = torch.randn(2, 3, 64, 64)
    feats = body(x)
    # max first, then average (layers.py:178)
    want = torch.cat([feats.amax((2, 3)), feats.mean((2, 3))], 1)
    torch.testing.assert_close(head[1](head[0](feats)), want)


def test_pretrained_weights_are_downloaded_with_their_hash_checked_or_offline_one_line(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    c, _ = composed(*FASTAI)
    calls = []

    # what an offline machine gets from torch.hub (no network in tests)
    def offline(url, **kwargs):
        calls.append((url, kwargs))
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(
        ConfigError,
        match=r"resnet18-f37072fd\.pth is missing and could not be downloaded"
        r".*model\.pretrained=false",
    ) as e:
        build_model(c.model, 100)
    assert "\n" not in str(e.value) and not list(tmp_path.rglob("*.pth"))
    assert calls == [("https://download.pytorch.org/models/resnet18-f37072fd.pth",
                      {"progress": True, "check_hash": True})]


def fastai_stepper_reference(n_steps, lr_max, div=25.0, pct=0.3, moms=(0.95, 0.85)):
    """fastai 1.0.42 OneCycleScheduler + Stepper, as written there (one_cycle.py:21-43,
    callback.py:308-332): the (lr, mom) each batch trains with."""
    cos = lambda start, end, p: end + (start - end) / 2 * (math.cos(math.pi * p) + 1)
    a1 = int(n_steps * pct)
    phases = [[(lr_max / div, lr_max), (moms[0], moms[1]), max(1, a1), 0],
              [(lr_max, lr_max / div / 1e4), (moms[1], moms[0]), max(1, n_steps - a1), 0]]
    lr, mom, idx, used = lr_max / div, moms[0], 0, []
    for _ in range(n_steps):
        used.append((lr, mom))
        ph = phases[idx]
        ph[3] += 1
        lr, mom = cos(*ph[0], ph[3] / ph[2]), cos(*ph[1], ph[3] / ph[2])
        if ph[3] >= ph[2]:
            idx += 1
        if idx == 2:
            break
    return used


def test_one_cycle_lr_and_beta1_follow_fastais_stepper_and_adamw_is_true_weight_decay():
    c, _ = composed(*FASTAI)
    w = nn.Parameter(torch.randn(5))
    opt = build_optimizer(c.optimizer, [w])
    sched = build_schedule(c.schedule, opt, total_steps=23)
    seen = []
    for _ in range(23):
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
        sched.step()
    ref = fastai_stepper_reference(23, 3e-3)
    assert len(ref) == 23
    np.testing.assert_allclose(seen, ref, rtol=1e-12)
    # fastai's OptimWrapper.step (callback.py:38-47): p *= 1 - wd * lr, then Adam without weight
    # decay
    g = torch.randn(5)
    p_ref = w.detach().clone().requires_grad_(True)
    adam = torch.optim.Adam([p_ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    adamw = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-2)
    for _ in range(3):
        with torch.no_grad():
            p_ref.mul_(1 - 1e-2 * 1e-2)
        p_ref.grad, w.grad = g.clone(), g.clone()
        adam.step()
        adamw.step()
    torch.testing.assert_close(w.detach(), p_ref.detach(), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_fastai_sweep_labels_the_articles_columns(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli(
        "-m",
        "experiment=fastai_cifar100",
        "model=resnet18",
        "precision=fp32,fastai_fp16,amp",
        "model.pretrained=false",
        "dataset=synthetic",
        "dataset.num_classes=100",
        "dataset.train_size=16",
        "dataset.test_size=8",
        "dataset.image_size=32",
        "trainer.batch_size=8",
        "trainer.eval_batch_size=8",
        "trainer.max_steps=1",
        "trainer.device=cpu",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=${hydra.job.num}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {
        line.split()[2]: line
        for line in r.stdout.splitlines()
        if line.split()[:1] in (["0"], ["1"], ["2"])
    }
    # emulated on a CPU
    assert set(rows) == {"fp32", "fastai_fp16(x512)(emulated)", "amp(emulated)"}
    assert (
        "[article's column]" in rows["fp32"]
        and "[article's column]" in rows["fastai_fp16(x512)(emulated)"]
    )
    assert "[modern column]" in rows["amp(emulated)"]


# --------------------------------------------------------------------------------- fastai published
def test_every_fastai_published_value_matches_a_fastai_fp16_job_of_the_recipe():
    for v in load_source(PUBLISHED_DIR / "fastai_2080ti.yaml").values:
        model = v.match.get("model", "resnet18")
        c, s = composed("experiment=fastai_cifar100", f"model={model}", "precision=fastai_fp16")
        assert matches(v.match, s), v.id
        check_table(c, [row for row in FASTAI_TABLE])
        amp = composed("experiment=fastai_cifar100", f"model={model}", "precision=amp")[1]
        assert not matches(v.match, amp), v.id   # torch.amp is a modern column, not the article's
