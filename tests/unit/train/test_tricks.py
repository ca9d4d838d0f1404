"""The math of each bag-of-tricks piece: ResNet-9's size, ghost BN, frozen BN scales, patch
whitening, EMA, flip TTA, label smoothing, and the max-pool orders."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import compose_config
from mixprec.train.loop import Loop, LoopState, fit, total_steps
from mixprec.config import ConfigError, validate
from mixprec.data import DeviceBatches, synthetic_images
from mixprec.models import small_cnn
from mixprec.precision.policy import PrecisionPolicy
from mixprec.models.resnet9 import GhostBatchNorm, ResNet9, conv_bn
from mixprec.config import OptimizerConfig
from mixprec.train.optim import param_groups
from mixprec.train.tricks import EMA, cross_entropy, fit_patch_whitening, tta_logits
from mixprec.train.image_steps import ImageSteps, evaluate

SMALL = (8, 16, 32, 64)


def images(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g)


def test_resnet9_has_6_57m_parameters():
    n = sum(p.numel() for p in ResNet9().parameters())
    assert n == pytest.approx(6.57e6, rel=0.01)
    # the whitening stem swaps the 3x3 prep conv (3*64*9) for fixed whitening filters and a learnt
    # 1x1 conv (27*64), the same learnt size; frozen BN scales leave the biases as the only learnt
    # BN parameters
    stem = ResNet9(whitening=torch.randn(27, 3, 3, 3), frozen_bn_scale=1.0)
    assert sum(p.numel() for p in stem.parameters()) == n + 27 * 27
    learnt = sum(p.numel() for p in stem.parameters() if p.requires_grad)
    bn_weights = sum(m.weight.numel() for m in stem.modules() if isinstance(m, nn.BatchNorm2d))
    assert learnt == n - bn_weights and bn_weights == 64 + 128 * 3 + 256 + 512 * 3


def test_ghost_bn_is_bn_applied_to_each_split_in_training():
    torch.manual_seed(0)
    x = torch.randn(32, 4, 5, 5) * 3 + 1
    gbn = GhostBatchNorm(4, splits=4)
    with torch.no_grad():
        gbn.weight.uniform_(0.5, 2)
        gbn.bias.uniform_(-1, 1)
    y = gbn(x)
    for k in range(4):   # split k: samples k, k+4, k+8, ...
        part = x[k::4]
        expected = F.batch_norm(part, None, None, gbn.weight, gbn.bias, training=True, eps=gbn.eps)
        torch.testing.assert_close(y[k::4], expected, rtol=1e-5, atol=1e-5)
    whole = F.batch_norm(x, None, None, gbn.weight, gbn.bias, training=True, eps=gbn.eps)
    assert not torch.allclose(y, whole, atol=1e-3)   # it is not plain BN over the batch
    # running statistics: the mean of what each split's BN would have tracked (momentum 0.1 from 0
    # and 1), taken when the layer turns to evaluation
    gbn.eval()
    means = torch.stack([x[k::4].mean(dim=(0, 2, 3)) for k in range(4)])
    variances = torch.stack([x[k::4].transpose(0, 1).reshape(4, -1).var(dim=1) for k in range(4)])
    torch.testing.assert_close(gbn.running_mean, 0.1 * means.mean(0))
    torch.testing.assert_close(gbn.running_var, 0.9 + 0.1 * variances.mean(0))
    # evaluation: plain BN with those statistics
    torch.testing.assert_close(
        gbn(x),
        F.batch_norm(
            x, gbn.running_mean, gbn.running_var, gbn.weight, gbn.bias, training=False, eps=gbn.eps
        ),
    )


def test_frozen_bn_scales_do_not_move_and_biases_learn_at_their_own_rate():
    torch.manual_seed(0)
    model = ResNet9(
        10, SMALL, frozen_bn_scale=0.25, ghost_splits=4, activation="celu", celu_alpha=0.3
    )
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    params = [p for p in model.parameters() if p.requires_grad]
    groups, _ = param_groups(
        model, params, params, OptimizerConfig("sgd", lr=0.1, weight_decay=5e-4), "resnet9", 64
    )
    assert groups[1]["lr"] == pytest.approx(6.4) and groups[1]["weight_decay"] == pytest.approx(
        5e-4 / 64
    )
    assert {id(p) for p in groups[1]["params"]} == {id(m.bias) for m in bns}
    assert not {id(m.weight) for m in bns} & {id(p) for g in groups for p in g["params"]}
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("bn.weight"):
            assert torch.equal(p, torch.full_like(p, 0.25)), n       # frozen at the constant
        elif n.endswith("bn.bias") or n.endswith("conv.weight"):
            assert not torch.equal(p, before[n]), n                  # learnt
    # the first Nesterov step moves a bias (from 0, so no decay) by lr * factor * (1 + momentum) *
    # grad
    bias = bns[0].bias
    torch.testing.assert_close(
        before["prep.bn.bias"] - bias, 6.4 * 1.9 * bias.grad, rtol=1e-4, atol=1e-7
    )


def test_patch_whitening_makes_the_patch_covariance_the_identity():
    data = synthetic_images(
        validate(compose_config("dataset.train_size=64", "dataset.test_size=8")).dataset
    )
    x = (data.train_x.float() - torch.tensor(data.mean).view(1, 3, 1, 1) * 255) / (
        torch.tensor(data.std).view(1, 3, 1, 1) * 255)

    # of the filtered 3x3 patches of the data the filters were fitted on
    def second_moment(filters):
        z = F.conv2d(x, filters).transpose(0, 1).reshape(27, -1).double()
        return z @ z.T / (z.shape[1] - 1)

    exact = fit_patch_whitening(data.train_x, data.mean, data.std, 1e-9, torch.device("cpu"))
    assert exact.shape == (27, 3, 3, 3)
    torch.testing.assert_close(
        second_moment(exact), torch.eye(27, dtype=torch.float64), rtol=0, atol=1e-4
    )
    # with Page's eps the covariance is diagonal with entries L / (L + eps), largest eigenvalue
    # first
    page = fit_patch_whitening(data.train_x, data.mean, data.std, 0.01, torch.device("cpu"))
    m = second_moment(page)
    torch.testing.assert_close(m, torch.diag(m.diagonal()), rtol=0, atol=1e-4)
    assert (m.diagonal() < 1).all() and m.diagonal()[0] > m.diagonal()[-1]
    # ResNet-9's stem holds the filters fixed, in a padded 3x3 conv followed by a learnt 1x1 conv
    model = ResNet9(10, SMALL, whitening=page)
    whiten = model.prep.whiten
    assert (
        torch.equal(whiten.weight, page)
        and not whiten.weight.requires_grad
        and whiten.padding == (1, 1)
    )
    assert model.prep.conv.kernel_size == (1, 1) and model.prep.conv.weight.requires_grad


def test_ema_follows_its_update_rule():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = EMA(model, momentum=0.9, every=3)
    rho = 0.9 ** 3
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(1, 8):
        with torch.no_grad():
            for v in model.state_dict().values():
                if v.is_floating_point():
                    v.copy_(torch.randn_like(v))
            model[1].num_batches_tracked += 1
        ema.update(model)
        if step in (1, 4, 7):   # every 3 steps, starting with the first
            expected = {k: rho * e + (1 - rho) * v if e.is_floating_point() else e
                        for (k, e), v in zip(expected.items(), model.state_dict().values())}
        for k, v in ema.model.state_dict().items():
            torch.testing.assert_close(v, expected[k], msg=f"step {step}, {k}")
    assert ema.model[1].num_batches_tracked == 0           # integer buffers are not averaged
    copy = EMA(model, 0.9, 3)
    copy.load_state_dict(ema.state_dict())
    assert copy.steps == 7 and torch.equal(copy.model[0].weight, ema.model[0].weight)


def test_the_loop_evaluates_the_ema_weights():
    cfg = validate(compose_config("dataset.train_size=64", "dataset.test_size=32"))
    data = synthetic_images(cfg.dataset)
    cpu = torch.device("cpu")
    train = DeviceBatches(
        data.train_x, data.train_y, 16, data.mean, data.std, device=cpu, train=True
    )
    test = DeviceBatches(data.test_x, data.test_y, 32, data.mean, data.std, device=cpu, train=False)
    torch.manual_seed(0)
    model = small_cnn(8, 10)
    policy = PrecisionPolicy(cfg.precision, cpu)
    opt = torch.optim.SGD(policy.optimizer_params(policy.prepare_model(model)), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    # one update, at step 1: the EMA holds the weights after step 1
    ema = EMA(model, momentum=0.0, every=1000)
    trainer = validate(compose_config("trainer.max_steps=3")).trainer
    loop = Loop(
        policy, opt, trainer, total_steps(trainer, len(train)), progress=False
    )
    result = fit(
        ImageSteps(model, sched, test, ema=ema), train, loop, LoopState()
    )
    ema_loss, _, _ = evaluate(ema.model, test, policy)
    model_loss, _, _ = evaluate(model, test, policy)
    assert result["metrics"]["final_test_loss"] == pytest.approx(
        ema_loss
    ) and ema_loss != pytest.approx(model_loss)


def test_tta_averages_the_logits_of_an_image_and_its_mirror():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10)).eval()   # not mirror-invariant
    x = images(40)
    out, mean = tta_logits(model, x)
    torch.testing.assert_close(mean, (model(x) + model(torch.flip(x, dims=[3]))) / 2)
    assert not torch.allclose(mean, out)
    y = mean.argmax(1)
    # labels on which the two predictions score differently
    y[::3] = out.argmax(1)[::3]
    policy = PrecisionPolicy(validate(compose_config()).precision, torch.device("cpu"))
    loss, acc, acc_tta = evaluate(
        model, [(x[:24], y[:24]), (x[24:], y[24:])], policy, tta=True
    )
    assert acc == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert acc_tta == pytest.approx((mean.argmax(1) == y).float().mean().item()) and acc_tta != acc
    # the loss is the plain model's
    assert loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-5)
    assert evaluate(model, [(x, y)], policy)[2] is None


def test_label_smoothing_gives_the_closed_form_loss():
    a, k, eps = 2.0, 10, 0.2
    logits = torch.zeros(1, k)
    logits[0, 0] = a
    target = torch.tensor([0])
    # log-partition: log p_0 = a - z, log p_j = -z
    z = math.log(math.exp(a) + k - 1)
    # (1 - eps) * (z - a) + eps * mean_j(z - a * [j = 0])
    closed = z - (1 - eps) * a - eps * a / k
    assert cross_entropy(logits, target, eps).item() == pytest.approx(closed, rel=1e-6)
    # Page's form: (1 - a) * xent + a * mean(-log p)
    log_p = logits.log_softmax(1)
    page = (1 - eps) * F.nll_loss(log_p, target) + eps * (-log_p.mean())
    assert cross_entropy(logits, target, eps).item() == pytest.approx(page.item(), rel=1e-6)
    batch, ys = torch.randn(6, k), torch.randint(0, k, (6,))
    assert cross_entropy(batch, ys, eps, summed=True).item() == pytest.approx(
        6 * cross_entropy(batch, ys, eps).item()
    )


@pytest.mark.parametrize("act", [nn.ReLU, lambda: nn.CELU(0.075)])
def test_pool_orders_differ_only_as_the_article_says(act):
    """Max-pooling commutes with a monotone activation, so conv-BN-pool-act is conv-BN-act-pool
    exactly (Page's free 3 s); pooling before BN changes what BN's batch statistics see, so
    conv-pool-BN-act is a different network in training, and in evaluation the same one only while
    every BN scale is positive."""
    blocks = {}
    for order in ("conv_bn_act_pool", "conv_bn_pool_act", "conv_pool_bn_act"):
        torch.manual_seed(0)
        blocks[order] = conv_bn(3, 6, nn.BatchNorm2d, act, order)
    state = blocks["conv_bn_act_pool"].state_dict()
    for b in blocks.values():
        b.load_state_dict(state)
    x = images(16) * 2
    base, same, pooled = (
        blocks[o](x) for o in ("conv_bn_act_pool", "conv_bn_pool_act", "conv_pool_bn_act")
    )
    torch.testing.assert_close(same, base)
    assert not torch.allclose(pooled, base, atol=1e-3)
    with torch.no_grad():
        bn = blocks["conv_bn_act_pool"].bn
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
    for b in blocks.values():
        b.load_state_dict(blocks["conv_bn_act_pool"].state_dict())
        b.eval()
    base, same, pooled = (
        blocks[o](x) for o in ("conv_bn_act_pool", "conv_bn_pool_act", "conv_pool_bn_act")
    )
    torch.testing.assert_close(same, base)
    torch.testing.assert_close(pooled, base)
    with torch.no_grad():
        for b in blocks.values():
            # a negative scale reverses the order max-pool picks
            b.bn.weight[0] = -1.0
    base, same, pooled = (
        blocks[o](x) for o in ("conv_bn_act_pool", "conv_bn_pool_act", "conv_pool_bn_act")
    )
    torch.testing.assert_close(same, base)
    assert not torch.allclose(pooled[:, 0], base[:, 0], atol=1e-3)
    torch.testing.assert_close(pooled[:, 1:], base[:, 1:])
    # the whole network, same weights: the two equivalent orders give the same logits; sizes do not
    # change
    nets = {}
    for order in ("conv_bn_act_pool", "conv_bn_pool_act", "conv_pool_bn_act"):
        torch.manual_seed(0)
        nets[order] = ResNet9(10, SMALL, pool_order=order)
    torch.testing.assert_close(nets["conv_bn_pool_act"](images(8, 1).repeat(1, 1, 2, 2)),
                               nets["conv_bn_act_pool"](images(8, 1).repeat(1, 1, 2, 2)))
    assert len({sum(p.numel() for p in n.parameters()) for n in nets.values()}) == 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trick.celu=true"],
            "trick.celu=true: only model=resnet9 has this switch (model=resnet18)",
        ),
        (
            ["trick.whitening=true", "model=small_cnn"],
            "trick.whitening=true: only model=resnet9 has this switch",
        ),
        (
            ["model=resnet9", "trick.ghost_bn=true", "trainer.batch_size=24"],
            "trick.ghost_splits=16: must divide trainer.batch_size=24",
        ),
        (["trick.ema_momentum=1.0"], "trick.ema_momentum=1.0: must be in [0, 1)"),
        (
            ["model=resnet9", "model.channels=[64,128,256]"],
            "model.channels=[64, 128, 256]: must be 4 positive integers",
        ),
    ],
)
def test_bad_trick_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides))
    assert str(e.value).startswith(message)


# -- Page's ladder made fast without changing its arithmetic: each faster piece against the code it
# replaced ----

def old_ema_update(ema: EMA, model: nn.Module) -> None:
    """EMA.update as it was (a lerp_ per tensor of state_dict()): the reference for the foreach
    update."""
    ema.steps += 1
    if (ema.steps - 1) % ema.every:
        return
    with torch.no_grad():
        for ema_v, v in zip(ema.model.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(v, 1 - ema.rho)


def half_resnet9(**options) -> nn.Module:
    """A narrow ResNet-9 as the ladder trains it: fp16 weights, BatchNorm in fp32."""
    torch.manual_seed(0)
    model = ResNet9(10, SMALL, **options).half()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.float()
    return model


def ops_of(fn) -> int:
    from helpers import load_script
    counter = load_script("bench_ladder_ops").OpCounter()
    with counter:
        fn()
    return sum(counter.parts.values())


# on a GPU the foreach lerp is CUDA's multi-tensor kernel and ghost BN cuDNN's: the same checks
# there
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_ema_update_is_the_per_tensor_lerp_in_one_dispatch_per_dtype(device):
    model = half_resnet9(ghost_splits=4).to(device)
    new, old = EMA(model, 0.99, 2), EMA(model, 0.99, 2)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        with torch.no_grad():
            for v in model.state_dict().values():
                if v.is_floating_point():
                    v.add_(torch.randn(v.shape, generator=g).to(device, v.dtype))
        n_ops = ops_of(lambda: new.update(model))
        old_ema_update(old, model)
        # fp16 weights, fp32 BatchNorm: two foreach lerps
        assert n_ops == (2 if step % 2 == 0 else 0)
        for (k, a), b in zip(new.model.state_dict().items(), old.model.state_dict().values()):
            assert torch.equal(a, b), f"step {step}: {k}"   # bit-equal: the same lerp per element
    old.steps = 0
    # the loop it replaced: a detach and a lerp_ per tensor
    assert ops_of(lambda: old_ema_update(old, model)) > 40


class OldGhostBatchNorm(nn.BatchNorm2d):
    """GhostBatchNorm's NCHW path as it was (running statistics averaged over the splits every
    step): the reference."""

    def __init__(self, num_features, splits):
        super().__init__(num_features)
        self.splits = splits

    def forward(self, x):
        n, c, h, w = x.shape
        s = self.splits
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        y = F.batch_norm(
            x.reshape(n // s, s * c, h, w),
            mean,
            var,
            self.weight.repeat(s),
            self.bias.repeat(s),
            True,
            self.momentum,
            self.eps,
        )
        with torch.no_grad():
            self.running_mean.copy_(mean.view(s, c).mean(0))
            self.running_var.copy_(var.view(s, c).mean(0))
        return y.view(n, c, h, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ghost_bn_computes_the_same_numbers_in_both_layouts_as_before(dtype, device):
    """channels_last goes through the NCHW batch_norm call (copies each way), so both layouts give
    bit-equal outputs and gradients, equal to the NCHW code before, step after step; before,
    channels_last normalised per split in its own arithmetic (fp32 var_mean, then scale and shift).
    The running statistics are the per-split ones averaged when the layer turns to evaluation
    (Page's), not every step: the same mean rounded in another order, equal to the code before
    within fp32 rounding (1e-6 relative) after 3 steps, bit-equal after 1."""
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(32, 4, 5, 5, generator=g) * 3 + k).to(device, dtype) for k in range(3)]
    grad = torch.randn(32, 4, 5, 5, generator=g).to(device, dtype)
    results, stats = [], []
    for cls, layout in (
        (OldGhostBatchNorm, torch.contiguous_format),
        (GhostBatchNorm, torch.contiguous_format),
        (GhostBatchNorm, torch.channels_last),
    ):
        bn, out = cls(4, splits=4).to(device), []
        with torch.no_grad():
            bn.weight.copy_(torch.linspace(0.5, 2, 4))
            bn.bias.copy_(torch.linspace(-1, 1, 4))
        for x in xs:
            xi = x.detach().contiguous(memory_format=layout).requires_grad_(True)
            y = bn(xi)
            assert y.is_contiguous(memory_format=layout) and y.dtype == dtype
            y.backward(grad.contiguous(memory_format=layout))
            out += [y, xi.grad, bn.weight.grad.clone(), bn.bias.grad.clone()]
            if len(out) == 4:
                # after one step, collated
                stats.append({k: v.clone() for k, v in bn.state_dict().items()})
        results.append(out)
        bn.eval()
        stats.append({k: v.clone() for k, v in bn.state_dict().items()})
    for i, (before, nchw, nhwc) in enumerate(zip(*results)):
        assert torch.equal(nchw, before) and torch.equal(nhwc, before), (
            "y",
            "x.grad",
            "weight.grad",
            "bias.grad",
        )[i % 4]
    one, three = stats[0::2], stats[1::2]
    for name in ("running_mean", "running_var"):
        assert torch.equal(one[1][name], one[0][name]) and torch.equal(one[2][name], one[1][name])
        torch.testing.assert_close(three[1][name], three[0][name], rtol=1e-6, atol=0)
        assert torch.equal(three[2][name], three[1][name])


def test_ghost_bn_loads_weights_saved_without_its_split_statistics():
    """A state saved before GhostBatchNorm kept Page's per-split statistics (running_mean/var only)
    still loads: each split starts from the running statistics, and evaluation gives what it
    gave."""
    old = GhostBatchNorm(4, splits=2).eval()
    old.running_mean.copy_(torch.arange(4.0))
    old.running_var.copy_(torch.arange(1.0, 5.0))
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("split_")}
    new = GhostBatchNorm(4, splits=2)
    new.load_state_dict(state)
    assert torch.equal(new.split_mean, torch.arange(4.0).repeat(2))
    assert torch.equal(new.split_var, torch.arange(1.0, 5.0).repeat(2))
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(new.eval()(x), old(x))
