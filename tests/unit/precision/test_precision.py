"""Every precision mode trains 2 real steps on the CPU with the dtypes it promises; the loss scalers
behave."""
import copy

import pytest
import torch
from torch import nn

from helpers import compose_config
from mixprec.config import validate
from mixprec.models import small_cnn
from mixprec.train.optim import build_optimizer
from mixprec.precision.policy import PrecisionPolicy
from mixprec.train.step import backward_and_step

MODES = ["fp32", "tf32", "amp", "amp_bf16", "half", "bf16", "o0", "o1", "o2", "o3"]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# mode: (param dtype, autocast dtype of a conv output, BN param dtype, master weights, dynamic
# scaler)
EXPECTED = {
    "fp32": (F32, F32, F32, False, False), "tf32": (F32, F32, F32, False, False),
    "amp": (F32, F16, F32, False, True), "amp_bf16": (F32, BF16, F32, False, False),
    "half": (F16, F16, F16, False, False), "bf16": (BF16, BF16, BF16, False, False),
    "o0": (F32, F32, F32, False, False), "o1": (F32, F16, F32, False, True),
    "o2": (F16, F16, F32, True, True), "o3": (F16, F16, F16, False, False),
}


def policy_for(mode, *overrides, optimizer="sgd"):
    config = validate(compose_config(f"precision={mode}", f"optimizer={optimizer}", *overrides))
    torch.manual_seed(0)
    model = small_cnn(8, 10)
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    model = policy.prepare_model(model)
    opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
    return model, policy, opt


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def forward_loss(model, policy, x, y):
    with policy.autocast():
        out = model(policy.cast_input(x))
    return out, nn.functional.cross_entropy(out.float(), y)


# every mode with Adam in the quick loop; SGD's momentum buffers in fp32, o2 and half there too,
# in the other modes slow
SGD_QUICK = ("fp32", "o2", "half")


@pytest.mark.parametrize("optimizer,mode", [
    (o, m) if o == "adam" or m in SGD_QUICK else pytest.param(o, m, marks=pytest.mark.slow)
    for o in ("sgd", "adam") for m in MODES
])
def test_two_steps_with_promised_dtypes(mode, optimizer):
    param_dt, compute_dt, bn_dt, master, dynamic = EXPECTED[mode]
    # Adam on fp16 weights needs eps >= ~1e-4 (1e-8 rounds to 0 in fp16: see the pitfall test below)
    eps = ["optimizer.eps=1e-4"] if optimizer == "adam" and param_dt == F16 and not master else []
    model, policy, opt = policy_for(mode, *eps, optimizer=optimizer)
    conv, bn = model[0], model[1]
    x, y = batch()
    before = [p.detach().float().clone() for p in policy.stepped_params()]
    for _ in range(2):
        out, loss = forward_loss(model, policy, x, y)
        assert conv.weight.dtype == param_dt and bn.weight.dtype == bn_dt
        assert conv(policy.cast_input(x)).dtype == param_dt  # outside autocast: the weights' dtype
        with policy.autocast():
            assert conv(policy.cast_input(x)).dtype == compute_dt
        assert loss.dtype == F32 and torch.isfinite(loss)
        grads = []   # the gradients' dtypes after the backward, before the step
        seen = lambda: grads.append((conv.weight.grad.dtype, bn.weight.grad.dtype))
        skipped = backward_and_step(loss, policy, opt, after_backward=seen)
        assert grads[-1] == (param_dt, bn_dt)
        opt.zero_grad(set_to_none=True)
        assert not skipped
    stepped = policy.stepped_params()
    assert all(p.dtype == (F32 if master else q.dtype) for p, q in zip(stepped, model.parameters()))
    assert (policy.master_params is not None) == master
    if master:  # the fp16 model holds the fp32 masters rounded to fp16
        assert all(
            torch.equal(p.detach(), m.detach().to(p.dtype))
            for p, m in zip(model.parameters(), stepped)
        )
    state = opt.state[stepped[0]]
    buffers = [v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
    # optimizer state in the stepped dtype
    assert buffers and all(b.dtype == stepped[0].dtype for b in buffers)
    assert any(not torch.equal(b, a) for a, b in zip(before, [p.detach().float() for p in stepped]))
    assert isinstance(policy.scaler, torch.amp.GradScaler) and policy.scaler.is_enabled() == dynamic


def test_dynamic_scale_grows_after_clean_steps_and_halves_on_overflow():
    model, policy, opt = policy_for(
        "amp", "precision.init_scale=1024", "precision.growth_interval=2"
    )
    x, y = batch()
    scales = []
    for _ in range(2):
        assert not backward_and_step(forward_loss(model, policy, x, y)[1], policy, opt)
        opt.zero_grad(set_to_none=True)
        scales.append(policy.scaler.get_scale())
    assert scales == [1024.0, 2048.0]            # grew after growth_interval clean steps
    weights = [p.detach().clone() for p in model.parameters()]
    overflow = lambda: model[0].weight.grad[0, 0, 0, 0].fill_(float("inf"))  # injected
    loss = forward_loss(model, policy, x, y)[1]
    assert backward_and_step(loss, policy, opt, after_backward=overflow)   # skipped ...
    assert policy.scaler.get_scale() == 1024.0     # ... and the scale halved
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_o2_overflow_skips_and_keeps_masters():
    model, policy, opt = policy_for("o2", "precision.init_scale=1024")
    x, y = batch()
    masters = [m.detach().clone() for m in policy.master_params]
    overflow = lambda: model[0].weight.grad.fill_(float("inf"))
    loss = forward_loss(model, policy, x, y)[1]
    assert backward_and_step(loss, policy, opt, after_backward=overflow)
    assert policy.scaler.get_scale() == 512.0
    assert all(torch.equal(a, b) for a, b in zip(masters, policy.master_params))
    assert all(p.grad is None for p in model.parameters())   # fp16 grads were handed to the masters


def test_static_scale_multiplies_the_gradients_and_unscales_before_the_step():
    ref_model, ref_policy, _ = policy_for("half")
    model, policy, opt = policy_for("half", "precision.loss_scale=128")
    x, y = batch()
    ref_policy.scaler.scale(forward_loss(ref_model, ref_policy, x, y)[1]).backward()
    policy.scaler.scale(forward_loss(model, policy, x, y)[1]).backward()
    g_ref, g = ref_model[-1].weight.grad.float(), model[-1].weight.grad.float()
    assert torch.allclose(g, 128 * g_ref, rtol=1e-2, atol=1e-3)
    policy.scaler.unscale_(opt)
    assert torch.allclose(model[-1].weight.grad.float(), g_ref, rtol=1e-2, atol=1e-4)
    assert policy.scaler.get_scale() == 128.0


def test_grad_clip_acts_on_unscaled_master_gradients():
    model, policy, opt = policy_for("o2", "precision.init_scale=4096")
    x, y = batch()
    loss = forward_loss(model, policy, x, y)[1]
    seen = {}
    real_step = opt.step

    def spy_step(*a, **k):
        seen["norm"] = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in policy.master_params])
        ).item()
        return real_step(*a, **k)

    opt.step = spy_step
    backward_and_step(loss, policy, opt, grad_clip=0.01)
    assert seen["norm"] == pytest.approx(0.01, rel=1e-3)


def test_fp32_state_dict_from_half_training():
    model, policy, opt = policy_for("o2")
    state = policy.fp32_state_dict(model)
    assert all(v.dtype == F32 for v in state.values() if v.is_floating_point())
    fresh = small_cnn(8, 10)
    fresh.load_state_dict(state)
    assert torch.equal(fresh[0].weight, policy.master_params[0])
    copy.deepcopy(fresh)


def test_pure_fp16_adam_with_default_eps_goes_nonfinite():
    """The pitfall: eps=1e-8 is 0 in fp16, so an fp16 Adam divides 0 by 0 where a second moment
    underflows."""
    assert torch.tensor(1e-8, dtype=F16).item() == 0.0
    model, policy, opt = policy_for("half", optimizer="adam")
    x, y = batch()
    finite = []
    for _ in range(3):
        loss = forward_loss(model, policy, x, y)[1]
        finite.append(
            bool(torch.isfinite(loss)) and all(torch.isfinite(p).all() for p in model.parameters())
        )
        backward_and_step(loss, policy, opt)
        opt.zero_grad(set_to_none=True)
    assert not all(finite)
