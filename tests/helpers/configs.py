"""Tiny job configs (override lists) shared by test modules of several rooms, and the sweep
parameters of a preset."""
import yaml

from helpers import CONF


SMALL = [
    "model=small_cnn",
    "model.width=8",
    "dataset.image_size=8",
    "dataset.train_size=320",
    "dataset.test_size=16",
    "trainer.batch_size=16",
    "trainer.eval_batch_size=16",
    "logger=none",
    "trainer.device=cpu",
    "trainer.deterministic=true",
    "dataset.augment=false",
]


# Tiny but real: a 1-layer GPT of width 32 on a synthetic corpus of 64 words, AdamW, deterministic,
# 50 steps.
GPT_JOB = [
    "logger=none",
    "model=gpt",
    "dataset=synthetic_text",
    "dataset.vocab_size=64",
    "dataset.train_size=4000",
    "dataset.test_size=400",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "dataset.bptt=16",
    "model.dropout=0",
    "model.vocab_multiple=1",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=8",
    "optimizer=adamw",
    "optimizer.lr=3e-3",
    "schedule=constant",
    "trainer.deterministic=true",
    "trainer.max_steps=50",
    "trainer.log_every=10",
    "trainer.warmup_steps=0",
    # FP8 emulated, as asserted: on a GPU machine auto would pick the GPU
    "trainer.device=cpu",
]


# Tiny but real, as helpers.TINY for images: a 2-layer LSTM of 8 units on a synthetic corpus of 40
# words, 2 steps, the example's optimizer (plain SGD, clipping, the plateau rule).
LM = [
    "logger=none",
    "trainer.max_steps=2",
    "model=lstm",
    "dataset=synthetic_text",
    "dataset.vocab_size=40",
    "dataset.train_size=1200",
    "dataset.test_size=200",
    "model.emsize=8",
    "model.nhid=8",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=5",
    "dataset.bptt=6",
    "optimizer.lr=5",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
    "trainer.grad_clip=0.25",
    "schedule=plateau",
    "trainer.warmup_steps=0",
    "trainer.device=cpu",
]


# eps 1e-4: Adam's default 1e-8 is 0 in fp16 (half would divide by it)
ADAM = ["optimizer=adam", "optimizer.eps=1e-4", "trainer.max_steps=3", "trainer.log_every=2",
        "trainer.warmup_steps=1"]


# A 2-layer GPT on a synthetic corpus of 64 words; every dim-0 of a parameter is even, so 2 ranks
# hold exactly half of each. Global batch 8: 4 columns per rank.
GPT_TINY = [
    "logger=none", "model=gpt", "dataset=synthetic_text", "dataset.vocab_size=64",
    "dataset.train_size=2000", "dataset.test_size=200", "model.n_layer=2", "model.n_head=2",
    "model.n_embd=32", "model.block_size=16", "dataset.bptt=16", "model.dropout=0",
    "model.vocab_multiple=1", "trainer.batch_size=8", "trainer.eval_batch_size=8",
    "schedule=constant", "trainer.deterministic=true", "trainer.max_steps=6",
    "trainer.log_every=2", "trainer.warmup_steps=0", "trainer.device=cpu", "trainer.epochs=1",
]


SGD = ["optimizer=sgd", "optimizer.lr=0.5"]


def sweep_params(name):
    return ((yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text()).get("hydra") or {})
            .get("sweeper", {}).get("params") or {})

# the tiny version of a ladder job: synthetic data (the sweep's cifar10 is overridden), narrow
# ResNet-9, 2 steps
LADDER_TINY = [
    "dataset=synthetic",
    "dataset.train_size=64",
    "dataset.test_size=32",
    "dataset.image_size=16",
    "trainer.batch_size=32",
    "trainer.eval_batch_size=32",
    "trainer.max_steps=2",
    "logger=none",
    "model.channels=[8,16,32,64]",
    "trainer.device=cpu",
]
