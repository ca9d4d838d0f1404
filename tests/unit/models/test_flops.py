"""FLOPs per sample (MFU rests on them) against counts written out by hand: 2 FLOPs per multiply-add
of every convolution and matmul, nothing for BatchNorm, activations and pooling (as torch's flop
counter, and as MFU conventions count)."""
import pytest
import torch

from helpers import compose_config, run_tiny
from helpers.expected import conv, small_cnn_flops
from mixprec.config import validate
from mixprec.models import build_model, forward_flops


def resnet18_cifar_flops(classes=10):
    # CIFAR stem (3x3 stride 1, no max-pool), then 4 stages of 2 BasicBlocks (two 3x3 convs each);
    # stages 2-4 halve the side in their first conv and add a 1x1 stride-2 shortcut; global average
    # pool; fc
    total = conv(3, 64, 3, 32) + 4 * conv(64, 64, 3, 32)
    for c_in, c, side in ((64, 128, 16), (128, 256, 8), (256, 512, 4)):
        total += conv(c_in, c, 3, side) + 3 * conv(c, c, 3, side) + conv(c_in, c, 1, side)
    return total + 2 * 512 * classes


@pytest.mark.slow
def test_small_cnn_flops_by_hand(tmp_path):
    expected = small_cnn_flops(8)
    assert expected == 2 * (
        3 * 8 * 9 * 1024 + 8 * 16 * 9 * 256 + 16 * 32 * 9 * 64 + 32 * 32 * 9 * 16 + 32 * 10
    )
    # the job's record: TINY is small_cnn, width 8, 32 px, 10 classes
    s = run_tiny(tmp_path, "trainer.device=cpu")
    assert s["metrics"]["forward_flops_per_sample"] == pytest.approx(expected, rel=0.01)
    assert s["metrics"]["train_flops_per_sample"] == pytest.approx(3 * expected, rel=0.01)


@pytest.mark.slow
def test_resnet18_flops_by_hand():
    expected = resnet18_cifar_flops()
    assert expected == 2 * 555_422_720   # the 555.42M MACs usually quoted for a CIFAR-10 ResNet-18
    model = build_model(validate(compose_config("model=resnet18")).model, 10)
    assert forward_flops(model, torch.zeros(1, 3, 32, 32)) == pytest.approx(expected, rel=0.01)
    # per sample
    assert forward_flops(model, torch.zeros(4, 3, 32, 32)) == pytest.approx(expected, rel=0.01)


def lstm_flops_per_token(vocab, emsize, nhid, nlayers):
    # each layer: 4 gates, each a matmul of the input (emsize for layer 1, nhid after) and one of
    # the hidden state; then the decoder nhid -> vocab. The embedding is a lookup (no FLOPs).
    gates = 4 * (emsize * nhid + nhid * nhid) + (nlayers - 1) * 4 * (nhid * nhid + nhid * nhid)
    return 2 * (gates + nhid * vocab)


@pytest.mark.slow
def test_lstm_flops_per_token_by_hand(tmp_path):
    lm = [
        "logger=none",
        "trainer.device=cpu",
        "trainer.max_steps=1",
        "model=lstm",
        "dataset=synthetic_text",
        "dataset.vocab_size=40",
        "dataset.train_size=600",
        "dataset.test_size=100",
        "model.emsize=12",
        "model.nhid=8",
        "model.nlayers=2",
        "trainer.batch_size=4",
        "trainer.eval_batch_size=5",
        "dataset.bptt=6",
        "schedule=plateau",
        "optimizer.momentum=0",
        "optimizer.weight_decay=0",
    ]
    s = run_tiny(tmp_path, base=lm)
    vocab = s["data"]["vocab_size"]
    expected = lstm_flops_per_token(vocab, 12, 8, 2)
    assert expected == 2 * (4 * (12 * 8 + 64) + 4 * (64 + 64) + 8 * vocab)
    assert s["metrics"]["forward_flops_per_sample"] == pytest.approx(expected, rel=0.01)
    assert s["metrics"]["flops_per"] == "token"
    # the example's medium model, with apex's vocabulary padding to a multiple of 8 (33278 -> 33280
    # rows)
    model = build_model(validate(compose_config("model=lstm", "model.emsize=650", "model.nhid=650",
                                                "model.vocab_multiple=8")).model, 33278)
    assert model.flops_per_token() == pytest.approx(
        lstm_flops_per_token(33280, 650, 650, 2), rel=0.01
    )
