"""Counts a test compares a job's record with, made independently of the code that records it:
FLOPs by hand, the memory ledger's parts from a config and a fresh model's parameter counts."""
from torch import nn

from helpers import TINY, compose_config
from mixprec.config import validate
from mixprec.models import build_model


def conv(c_in, c_out, k, side):
    """A k x k convolution producing a side x side map: 2 * C_in * C_out * k^2 per output
    position."""
    return 2 * c_in * c_out * k * k * side * side


def small_cnn_flops(w, classes=10, side=32):
    # each conv keeps the size, a 2x2 max-pool after each of the first three halves it
    return (conv(3, w, 3, side) + conv(w, 2 * w, 3, side // 2) + conv(2 * w, 4 * w, 3, side // 4)
            + conv(4 * w, 4 * w, 3, side // 8) + 2 * 4 * w * classes)


SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def fresh_model(config) -> nn.Module:
    """The job's model as built, in fp32, on the CPU."""
    d = config.dataset
    return build_model(config.model, d.vocab_size if config.model.is_language_model
                       else d.num_classes)


def expected_state(mode: str, overrides=()) -> dict:
    """The ledger's parameter parts counted from the mode's config and a fresh fp32 model's
    parameter counts alone (no storage is looked at): the weights in param_dtype (BatchNorm in fp32
    where the mode keeps it), fp32 masters under master weights, one gradient and Adam's two
    moments per parameter in the stepped dtype, Adam's step counter (an fp32 scalar) per tensor,
    and BatchNorm's running statistics in the weights' dtype (its step count an int64)."""
    config = validate(compose_config(*TINY, f"precision={mode}", *overrides))
    p = config.precision
    model = fresh_model(config)
    bn = sum(t.numel() for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             for t in m.parameters(recurse=False))
    tensors = list(model.parameters())
    n = sum(t.numel() for t in tensors)
    low = SIZE[p.param_dtype]
    weights = (bn * 4 + (n - bn) * low) if p.keep_bn_fp32 else n * low
    stepped = 4 * n if p.master_weights else weights
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    ints = sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_floating_point())
    return {"weights": weights, "masters": 4 * n if p.master_weights else 0, "grads": stepped,
            "optimizer": 2 * stepped + 4 * len(tensors), "parameters": n,
            "buffers": floats * (4 if p.keep_bn_fp32 else low) + ints}
