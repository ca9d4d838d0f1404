"""The ladder's tricks in real jobs: the model a `trick=page_10_tta` job trains has ghost BN, CELU,
frozen BN scales and the whitening stem, each checked by what it computes; `trick.ema=true`
evaluates (and saves) the averaged weights, recomputed here from the weights of every step; resume
continues exactly with EMA and with the DataLoader pipeline."""
import copy
import json
import math
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import mixprec.train.parts
import mixprec.tools.evaluate
import mixprec.train.tricks
from helpers import compose_config, run_tiny
from helpers.configs import LADDER_TINY
from helpers.fakes import SignalAt, with_clock
from mixprec.train.checkpoint import WEIGHTS
from mixprec.config import validate
from mixprec.data import build_image_data

LADDER = [*LADDER_TINY, "precision=fp32"]


def ghost_bn_by_hand(bn: nn.BatchNorm2d, x: torch.Tensor, splits: int) -> torch.Tensor:
    """Training-mode BatchNorm whose statistics are taken over each of `splits` interleaved parts of
    the batch."""
    out = torch.empty_like(x)
    for k in range(splits):
        part = x[k::splits]
        mean, var = (
            part.mean((0, 2, 3), keepdim=True),
            part.var((0, 2, 3), unbiased=False, keepdim=True),
        )
        out[k::splits] = ((part - mean) / torch.sqrt(var + bn.eps) * bn.weight.view(1, -1, 1, 1)
                          + bn.bias.view(1, -1, 1, 1))
    return out


def patch_covariance(images: torch.Tensor) -> np.ndarray:
    """Uncentred covariance of every 3x3x3 patch of the uint8 images, normalised per channel (mean,
    unbiased std)."""
    x = images.numpy().astype(np.float64)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.transpose(1, 0, 2, 3).reshape(3, -1).std(axis=1, ddof=1).reshape(1, 3, 1, 1)
    x = (x - mean) / std
    # N, C, H-2, W-2, 3, 3
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    # (c, kh, kw) per patch
    patches = windows.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 27)
    return patches.T @ patches / (len(patches) - 1)


def test_the_page_10_job_trains_the_model_its_tricks_promise(tmp_path, monkeypatch):
    c = validate(compose_config(*LADDER, "trick=page_10_tta"))
    assert c.trick.ghost_bn and c.trick.celu and c.trick.frozen_bn_scale and c.trick.whitening
    clock = with_clock(monkeypatch, cost=lambda k: 1.0)
    fit = mixprec.train.tricks.fit_patch_whitening

    # the whitening fit takes 5 s of the fake clock: setup time, timed apart (Page)
    def slow_fit(*args, **kwargs):
        clock.now += 5.0
        return fit(*args, **kwargs)

    monkeypatch.setattr(mixprec.train.tricks, "fit_patch_whitening", slow_fit)
    s = run_tiny(tmp_path, "trick=page_10_tta", base=LADDER)
    assert s["status"] == "completed"
    m = s["metrics"]
    assert m["setup_time_s"] == pytest.approx(5.0, rel=1e-9) and m["train_time_s"] == pytest.approx(
        2.0, rel=1e-9
    )
    (model,) = clock.models
    net = model.inner
    bns = [mod for mod in net.modules() if isinstance(mod, nn.BatchNorm2d)]
    assert len(bns) == 8

    # ghost BN: every BatchNorm normalises each of 16 interleaved parts of the batch by its own
    # statistics
    for bn in bns:
        probe = copy.deepcopy(bn).train()
        x = torch.randn(32, bn.num_features, 2, 2)
        torch.testing.assert_close(
            probe(x), ghost_bn_by_hand(probe, x, c.trick.ghost_splits), rtol=1e-4, atol=1e-4
        )

    # CELU(alpha) after every conv-BN: CELU(-1) = alpha * (exp(-1 / alpha) - 1), where ReLU gives 0
    acts = [mod for name, mod in net.named_modules() if name.endswith("act")]
    alpha = c.trick.celu_alpha
    assert len(acts) == 8 and alpha == 0.3
    for act in acts:
        assert act(torch.tensor([-1.0, 2.0])).tolist() == pytest.approx(
            [alpha * (math.exp(-1 / alpha) - 1), 2.0]
        )

    # frozen BN scales: still exactly bn_scale after training and not trained; the biases were
    # trained
    for bn in bns:
        assert not bn.weight.requires_grad and torch.all(bn.weight == c.trick.bn_scale)
    assert any(bn.bias.abs().max() > 0 for bn in bns)

    # the whitening stem: fixed 27 filters under which the training patches have covariance diag(L /
    # (L + eps))
    whiten = net.prep.whiten
    assert not whiten.weight.requires_grad and whiten.weight.shape == (27, 3, 3, 3)
    cov = patch_covariance(build_image_data(c.dataset).train_x[:c.trick.whitening_images])
    eigenvalues = np.linalg.eigvalsh(cov)[::-1]
    w = whiten.weight.detach().double().reshape(27, 27).numpy()
    np.testing.assert_allclose(
        w @ cov @ w.T, np.diag(eigenvalues / (eigenvalues + c.trick.whitening_eps)), atol=2e-3
    )


EMA = [
    "trainer.device=cpu",
    "trick.ema=true",
    "trick.ema_momentum=0.5",
    "trick.ema_every=2",
    "trainer.max_steps=4",
    "optimizer.lr=0.2",
]


@pytest.mark.slow
def test_an_ema_job_evaluates_and_saves_the_average_of_its_weights(tmp_path, monkeypatch):
    """Momentum 0.5 every 2 steps (rho = 0.25), updated after steps 1 and 3, from the initial
    weights: the average is recomputed from the model's state after each step (read at the start of
    the next forward, and at the end)."""
    states, built = [], []
    build = mixprec.train.parts.build_model

    def recording(cfg, n, **kw):
        model = build(cfg, n, **kw)
        model.register_forward_pre_hook(
            lambda mod, args: (
                states.append(copy.deepcopy(mod.state_dict())) if mod.training else None
            )
        )
        built.append(model)
        return model

    monkeypatch.setattr(mixprec.train.parts, "build_model", recording)
    s = run_tiny(tmp_path / "run", *EMA)
    assert s["status"] == "completed" and len(states) == 4
    after_step = states[1:] + [built[0].state_dict()]   # state after steps 1..4
    rho = 0.25
    expected = {k: v.clone() for k, v in states[0].items()}   # the initial weights
    for step in (1, 3):
        for k, v in expected.items():
            if v.is_floating_point():
                v.mul_(rho).add_(after_step[step - 1][k], alpha=1 - rho)
    saved = torch.load(tmp_path / "run" / WEIGHTS, weights_only=True)
    for k, v in expected.items():
        if v.is_floating_point():
            torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6)
    raw = after_step[-1]
    assert (
        max((saved[k] - raw[k]).abs().max().item() for k in raw if raw[k].is_floating_point())
        > 1e-3
    )

    # the recorded test loss is that of the averaged weights, not of the raw ones
    ema_eval = mixprec.tools.evaluate.evaluate_saved(tmp_path / "run", device="cpu")
    shutil.copytree(tmp_path / "run", tmp_path / "raw")
    torch.save({k: v for k, v in raw.items()}, tmp_path / "raw" / WEIGHTS)
    raw_eval = mixprec.tools.evaluate.evaluate_saved(tmp_path / "raw", device="cpu")
    assert s["metrics"]["final_test_loss"] == pytest.approx(ema_eval["test_loss"], rel=1e-5)
    assert abs(raw_eval["test_loss"] - ema_eval["test_loss"]) > 1e-3


# ------------------------------------------------------------------------------------------- resume


def interrupted_then_resumed(tmp_path, monkeypatch, *args):
    """(reference dir, resumed dir): the same job run through, and SIGTERMed at step 6 (epoch 2)
    then resumed."""
    build = mixprec.train.parts.build_model
    monkeypatch.setattr(
        mixprec.train.parts, "build_model", lambda cfg, n, **kw: SignalAt(build(cfg, n, **kw), at=0)
    )
    assert run_tiny(tmp_path / "reference", *args)["status"] == "completed"
    monkeypatch.setattr(
        mixprec.train.parts, "build_model", lambda cfg, n, **kw: SignalAt(build(cfg, n, **kw), at=6)
    )
    with pytest.raises(SystemExit):
        run_tiny(tmp_path / "run", *args)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"
    monkeypatch.setattr(
        mixprec.train.parts, "build_model", lambda cfg, n, **kw: SignalAt(build(cfg, n, **kw), at=0)
    )
    s = run_tiny(tmp_path / "run", *args, "trainer.resume=auto")
    assert s["status"] == "completed" and s["resumed"]["from_step"] == 6
    return tmp_path / "reference", tmp_path / "run"


def assert_same_weights_and_rows(a, b):
    wa, wb = (torch.load(d / WEIGHTS, weights_only=True) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    timing = {"samples_per_s", "epoch_time_s", "train_time_s", "eval_time_s"}
    ra, rb = ([{k: v for k, v in json.loads(line).items() if k not in timing}
               for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b))
    assert ra == rb


RESUMABLE = [
    "trainer.device=cpu",
    "trainer.max_steps=null",
    "trainer.epochs=2",
    "trainer.deterministic=true",
    "optimizer.lr=0.2",
]


@pytest.mark.slow
def test_resume_with_ema_continues_the_average(tmp_path, monkeypatch):
    """Interrupted after step 6, between EMA updates (steps 1, 4, 7 at every=3): the average and its
    step count must come back from the checkpoint, or the resumed job's saved (averaged) weights
    differ."""
    ref, run = interrupted_then_resumed(
        tmp_path,
        monkeypatch,
        *RESUMABLE,
        "trick.ema=true",
        "trick.ema_every=3",
        "trick.ema_momentum=0.5",
    )
    assert_same_weights_and_rows(ref, run)


@pytest.mark.slow
def test_resume_with_the_dataloader_pipeline_replays_its_data_order(tmp_path, monkeypatch):
    ref, run = interrupted_then_resumed(
        tmp_path, monkeypatch, *RESUMABLE, "dataset.pipeline=dataloader", "dataset.workers=0"
    )
    assert_same_weights_and_rows(ref, run)
