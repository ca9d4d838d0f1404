"""Fidelity to NVIDIA apex's word language model: the presets against main.py's defaults, the
published values against the runs they come from, the 2018 clipping of scaled fp16 gradients,
the plateau rule and the best-validation perplexity. Source read: NVIDIA/apex
examples/word_language_model at 0f703d13 and 28bdc04e (the fastai article's run) and at
254cad2d^ (main.py's last version, before the example was removed)."""
import math

import pytest
import torch
from torch import nn

from helpers import compose_config
from helpers.fidelity import check_table, composed
from mixprec.config import ConfigError, validate
from mixprec.train.optim import build_optimizer
from mixprec.precision.policy import PrecisionPolicy
from mixprec.train.step import backward_and_step
from mixprec.precision import emulation
from mixprec.report.published import PUBLISHED_DIR, load_source, matches


# --------------------------------------------------------------------------------------------- apex
# workload=apex_small_lstm: examples/word_language_model/main.py at apex 0f703d13 (28bdc04e: the
# same)
APEX_SMALL = [
    ("model.arch", "lstm", "main.py@0f703d13:19 --model LSTM"),
    ("model.emsize", 200, "main.py@0f703d13:21 --emsize 200"),
    ("model.nhid", 200, "main.py@0f703d13:23 --nhid 200"),
    ("model.nlayers", 2, "main.py@0f703d13:25 --nlayers 2"),
    ("optimizer.lr", 20.0, "main.py@0f703d13:27 --lr 20"),
    ("trainer.grad_clip", 0.25, "main.py@0f703d13:29 --clip 0.25"),
    ("trainer.epochs", 6, "README.md@0f703d13:13 python main.py --cuda --epochs 6"),
    ("trainer.batch_size", 20, "main.py@0f703d13:33 --batch_size 20"),
    ("dataset.bptt", 35, "main.py@0f703d13:35 --bptt 35"),
    ("model.dropout", 0.2, "main.py@0f703d13:37 --dropout 0.2"),
    ("model.tied", False, "main.py@0f703d13:39 --tied store_true (off)"),
    ("seed", 1111, "main.py@0f703d13:41 --seed 1111"),
    ("trainer.eval_batch_size", 10, "main.py@0f703d13:95 eval_batch_size = 10"),
    ("model.vocab_multiple", 1, "main.py@0f703d13:70 data.Corpus(args.data): no padding yet"),
    ("precision.name", "fp32", "README.md@0f703d13:13: no --fp16"),
    ("schedule.name", "plateau", "main.py@0f703d13:226 lr /= 4.0 when val_loss is not the best"),
    ("schedule.factor", 4.0, "main.py@0f703d13:226 lr /= 4.0"),
    ("optimizer.momentum", 0.0, "main.py@0f703d13:189 p.data.add_(-lr, grad): plain SGD"),
    ("optimizer.weight_decay", 0.0, "main.py@0f703d13:189: no weight decay"),
]
# experiment=apex_word_lm precision=apex_fp16_2018: main.py at 28bdc04e, the code on 2019-01-21
APEX_ARTICLE = [
    ("model.emsize", 200, "main.py@28bdc04e:20 --emsize 200"),
    ("model.nhid", 200, "main.py@28bdc04e:22 --nhid 200"),
    ("model.nlayers", 2, "main.py@28bdc04e:24 --nlayers 2"),
    ("optimizer.lr", 20.0, "main.py@28bdc04e:26 --lr 20"),
    (
        "trainer.grad_clip",
        0.25,
        "main.py@28bdc04e:28 --clip 0.25; :180 clip_grad_norm(model.parameters(), args.clip)",
    ),
    ("trainer.batch_size", 20, "main.py@28bdc04e:32 --batch_size 20"),
    ("dataset.bptt", 35, "main.py@28bdc04e:34 --bptt 35"),
    ("model.dropout", 0.2, "main.py@28bdc04e:36 --dropout 0.2"),
    ("model.tied", False, "main.py@28bdc04e:38 --tied store_true (off)"),
    ("seed", 1111, "main.py@28bdc04e:40 --seed 1111"),
    ("precision.loss_scale", 1.0, "main.py@28bdc04e:50 --static-loss-scale default=1"),
    ("precision.param_dtype", "float16", "main.py@28bdc04e:105 model.type(torch.cuda.HalfTensor)"),
    (
        "precision.master_weights",
        True,
        "main.py@28bdc04e:106 prep_param_lists; :182-186 master step and copy back",
    ),
    (
        "precision.clip_scaled_model_grads",
        True,
        "main.py@28bdc04e:173-185 backward of loss*S, clip, then grad/S",
    ),
    (
        "model.vocab_multiple",
        1,
        "main.py@28bdc04e:67 data.Corpus(args.data): padding came with e21946e0",
    ),
    ("trainer.eval_batch_size", 10, "main.py@28bdc04e:92 eval_batch_size = 10"),
    ("schedule.factor", 4.0, "main.py@28bdc04e:226 lr /= 4.0"),
    ("optimizer.momentum", 0.0, "main.py@28bdc04e:185 master -= grad * lr / S: plain SGD"),
]
# experiment=apex_word_lm_readme precision=apex_fp16: main.py at 254cad2d^ (its last version)
APEX_README = [
    ("model.emsize", 1504, "main.py:20 --emsize 1504"),
    ("model.nhid", 1504, "main.py:22 --nhid 1504"),
    ("model.nlayers", 2, "main.py:24 --nlayers 2"),
    ("optimizer.lr", 20.0, "main.py:26 --lr 20"),
    (
        "trainer.grad_clip",
        0.25,
        "main.py:28 --clip 0.25; :200 clip_grad_norm(master_params, args.clip)",
    ),
    ("trainer.epochs", 40, "main.py:30 --epochs 40: the README's 'converged'"),
    ("trainer.batch_size", 24, "main.py:32 --batch_size 24"),
    ("dataset.bptt", 35, "main.py:34 --bptt 35"),
    ("model.dropout", 0.65, "main.py:36 --dropout 0.65"),
    ("model.tied", False, "main.py:38 --tied store_true (off)"),
    ("seed", 1111, "main.py:40 --seed 1111"),
    ("precision.loss_scale", 128.0, "main.py:50 --static-loss-scale default=128.0"),
    ("precision.param_dtype", "float16", "main.py:117 model.type(torch.cuda.HalfTensor)"),
    (
        "precision.master_weights",
        True,
        "main.py:118 prep_param_lists; :196-203 master step and copy back",
    ),
    (
        "precision.clip_scaled_model_grads",
        False,
        "main.py:196-200 master grads / S, then clip_grad_norm(master_params)",
    ),
    ("model.vocab_multiple", 8, "main.py:69 data.Corpus(args.data, pad_to_multiple_of=8)"),
    ("trainer.eval_batch_size", 10, "main.py:94 eval_batch_size = 10"),
    ("schedule.factor", 4.0, "main.py:244 lr /= 4.0"),
]


def test_apex_presets_are_main_pys_defaults():
    check_table(composed("workload=apex_small_lstm")[0], APEX_SMALL)
    c, _ = composed("experiment=apex_word_lm", "precision=apex_fp16_2018")
    check_table(c, APEX_ARTICLE)
    assert c.trainer.epochs == 30   # the fastai article's run
    check_table(composed("experiment=apex_word_lm_readme", "precision=apex_fp16")[0], APEX_README)
    sweep = compose_config("experiment=apex_word_lm").hydra.sweeper.params
    # the article's two columns, and amp beside them
    assert sweep["precision"] == "fp32,apex_fp16_2018,amp"
    sweep = compose_config("experiment=apex_word_lm_readme").hydra.sweeper.params
    # README@859f528b:14
    assert (sweep["precision"], sweep["precision.loss_scale"]) == ("apex_fp16", "1.0,128.0")


def test_apex_published_values_match_only_the_runs_they_come_from():
    values = {v.id: v for v in load_source(PUBLISHED_DIR / "apex_word_lm.yaml").values}
    article = [
        composed("experiment=apex_word_lm", f"precision={p}")[1]
        for p in ("fp32", "apex_fp16_2018", "amp")
    ]
    for vid, scale in (("fp16_ppl_scale1", 1), ("fp16_ppl_scale128", 128)):
        c, s = composed(
            "experiment=apex_word_lm_readme", "precision=apex_fp16", f"precision.loss_scale={scale}"
        )
        check_table(c, [row for row in APEX_README if row[0] != "precision.loss_scale"])
        assert matches(values[vid].match, s)
        at30 = composed(
            "experiment=apex_word_lm_readme",
            "precision=apex_fp16",
            f"precision.loss_scale={scale}",
            "trainer.epochs=30",
        )[1]
        assert not matches(values[vid].match, at30)   # 30 epochs is not "converged" at 40
        # the article's run has no README number
        assert not any(matches(values[vid].match, a) for a in article)
    # 117.61 is a Penn Treebank perplexity (pytorch/examples bcea1f5 "on PTB"): tied to PTB, it
    # matches no Wikitext-2 run, however close its model
    ptb = values["fp32_ppl_6_epochs_ptb"]
    assert ptb.match["dataset"] == "ptb" and "on PTB" in ptb.quote and "bcea1f5" in ptb.quote
    assert "Wikitext-2" not in ptb.quote and "Penn Treebank" in ptb.label
    small = composed("workload=apex_small_lstm")[1]
    assert matches({k: v for k, v in ptb.match.items() if k != "dataset"}, small) and not matches(
        ptb.match, small
    )
    for v in values.values():   # every value names its dataset; only the PTB one names PTB
        assert v.match["dataset"] == ("ptb" if "PTB" in v.quote else "wikitext2"), v.id


def _tiny_fp16_step(precision: str, emulate: bool, lr: float = 0.5, clip: float = 0.25):
    """One SGD step of a tiny fp16 model at loss scale 128: (model grads as backward left them,
    masters before, masters after)."""
    cfg = validate(
        compose_config(
            f"precision={precision}",
            "precision.loss_scale=128",
            "optimizer=sgd",
            f"optimizer.lr={lr}",
            "optimizer.momentum=0",
            "optimizer.weight_decay=0",
        )
    )
    with emulation.numerics(emulate):
        torch.manual_seed(0)
        policy = PrecisionPolicy(cfg.precision, torch.device("cpu"))
        model = policy.prepare_model(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
        opt = build_optimizer(cfg.optimizer, policy.optimizer_params(model))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        loss = 0.01 * ((model(policy.cast_input(x)).float() - y) ** 2).mean()
        before = [m.detach().clone() for m in policy.master_params]
        scaled = []   # the model's gradients after the backward, still scaled
        seen = lambda: scaled.extend(p.grad.float().clone() for p in model.parameters())
        backward_and_step(loss, policy, opt, grad_clip=clip, after_backward=seen)
        after = [m.detach().clone() for m in policy.master_params]
    return scaled, before, after


@pytest.mark.parametrize("emulate", [False, True])
def test_apex_2018_clips_the_scaled_fp16_gradients_before_unscaling(emulate):
    """main.py@28bdc04e:173-185 by hand: loss * S, backward, PyTorch 1.0's clip_grad_norm_ on the
    fp16 model's (scaled) gradients (each norm in fp16, their squares summed in double, coefficient
    0.25 / (total + 1e-6) applied in fp32 and stored in fp16), then the masters step by grad * lr /
    S."""
    lr, clip, scale = 0.5, 0.25, 128.0
    scaled, before, after = _tiny_fp16_step("apex_fp16_2018", emulate, lr, clip)
    norms = [
        float(torch.tensor(math.sqrt(sum(v * v for v in g.flatten().tolist()))).half())
        for g in scaled
    ]
    total = math.sqrt(sum(n * n for n in norms))
    assert total / scale < clip < total   # the scaled norm is clipped; the true one would not be
    coef = torch.tensor(min(1.0, clip / (total + 1e-6)), dtype=torch.float32)
    want = [b - (g * coef).half().float() * (lr / scale) for g, b in zip(scaled, before)]
    for w, a in zip(want, after):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-7)
    # the later code (43522e63, precision=apex_fp16) unscales first and clips the true norm: nothing
    # to clip here
    scaled2, before2, after2 = _tiny_fp16_step("apex_fp16", emulate, lr, clip)
    for g, b, a in zip(scaled2, before2, after2):
        torch.testing.assert_close(a, b - g * (lr / scale), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(after[0], after2[0], rtol=0, atol=1e-6)


def test_clip_scaled_model_grads_needs_a_fixed_loss_scale():
    with pytest.raises(ConfigError, match="clip_scaled_model_grads=true with loss_scale=dynamic"):
        validate(compose_config("precision=o2", "+precision.clip_scaled_model_grads=true"))


def test_plateau_divides_on_like_apexs_lr_over_4_however_small_the_lr():
    """main.py@28bdc04e:226 and @254cad2d^:244: `lr /= 4.0` after every epoch without a better
    validation loss, with no floor; PyTorch's ReduceLROnPlateau skips a division smaller than its
    eps (1e-8 by default), which from lr 20 would hold the lr at 20 / 4^16 after the 16th."""
    from mixprec.train.optim import build_schedule

    c, _ = composed("experiment=apex_word_lm_readme", "precision=apex_fp16")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=c.optimizer.lr)
    schedule = build_schedule(c.schedule, optimizer, 100)
    lr, apex = [], c.optimizer.lr
    for epoch in range(21):   # the first epoch sets the best; the next 20 are no better
        schedule.step(5.0)
        if epoch:
            apex /= 4.0
        lr.append(optimizer.param_groups[0]["lr"])
    assert lr[-1] == apex == 20.0 / 4**20 and lr[16] == 20.0 / 4**16


def test_the_report_reads_the_best_validation_models_test_perplexity_and_says_so(tmp_path):
    import json

    from mixprec.report.make import make_report

    _, s = composed(
        "experiment=apex_word_lm_readme", "precision=apex_fp16", "precision.loss_scale=128"
    )
    s.update(
        status="completed",
        job={"num": 0},
        metrics={
            "final_test_ppl": 95.0,
            "test_ppl_at_best_valid": 91.0,
            "final_test_loss": math.log(95.0),
            "train_time_s": 1.0,
        },
    )
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps(s))
    make_report([str(tmp_path)], out=tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    row = next(
        line
        for line in md.splitlines()
        if line.startswith("| apex_word_lm | converged fp16 test perplexity, loss scale 128")
    )
    # the best-validation model's, not the last
    assert "| 91 perplexity |" in row and "95" not in row
    assert "`test_ppl`: test perplexity of the best-validation model" in md
