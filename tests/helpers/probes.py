"""The numerics probe on constructed models: a fit of random batches under a precision, the
context a verdict is judged in, a layer that scales its input."""
import torch
from torch import nn

from mixprec.config import PrecisionConfig, ProbeConfig, TrainerConfig
from mixprec.numerics.probe import build_probe
from mixprec.precision.policy import PrecisionPolicy
from mixprec.train import image_steps
from mixprec.train.loop import Loop, LoopState, fit, total_steps


CPU = torch.device("cpu")


def ctx(
    precision: PrecisionConfig, status: str, steps: int, optimizer="sgd", eps=1e-8, bn_eval=False
) -> dict:
    return {
        "precision": precision.name,
        "param_dtype": precision.param_dtype,
        "autocast_dtype": precision.autocast_dtype,
        "master_weights": precision.master_weights,
        "loss_scale": precision.loss_scale,
        "keep_bn_fp32": precision.keep_bn_fp32,
        "optimizer": optimizer,
        "eps": eps,
        "bn_eval": bn_eval,
        "status": status,
        "steps": steps,
    }


def fit_probed(
    model, precision: PrecisionConfig, tmp_path, probe="ranges", steps=3, x_scale=1.0,
    bn_eval=False, optimizer=None,
):
    """loop.fit on a constructed model and random batches (x_scale=0: blank ones), stepped by SGD or
    `optimizer(params)`; returns (result, numerics summary, rows)."""
    torch.manual_seed(0)
    batches = [
        (torch.randn(8, 3, 8, 8) * x_scale, torch.randint(0, 10, (8,))) for _ in range(steps)
    ]
    policy = PrecisionPolicy(precision, CPU)
    model = policy.prepare_model(model)
    params = policy.optimizer_params(model)
    opt = optimizer(params) if optimizer else torch.optim.SGD(params, lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tr = TrainerConfig(epochs=1, warmup_steps=0, channels_last=False, log_every=1)
    p = build_probe(ProbeConfig(name=probe, every=1), model, tmp_path)
    loop = Loop(
        policy, opt, tr, total_steps(tr, len(batches)), progress=False, probe=p
    )
    steps_ = image_steps.ImageSteps(model, sched, batches[:1], bn_eval=bn_eval)
    result = fit(steps_, batches, loop, LoopState())
    rows = p.rows()
    p.close()
    return result, p.summary(), rows


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor
