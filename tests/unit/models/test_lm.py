"""Word language models: bptt windows and targets, the hidden state cut between windows, clipping of
unscaled gradients, learning on a repetitive corpus, perplexity, every precision x RNN kind, the
apex_word_lm sweep, and scripts/generate.py."""
import json
import math

import pytest
import torch

from mixprec.precision import emulation
from torch import nn

from helpers import ROOT, compose_config, run_cli, run_tiny, load_script
from helpers.configs import LM
from helpers.fixtures import one_thread  # noqa: F401  (autouse: tiny models on one thread)
from mixprec.train.loop import Loop, LoopState, fit, total_steps
from mixprec.train import lm_steps
from mixprec.config import ConfigError, validate
from mixprec.train.optim import build_schedule
from mixprec.precision.policy import PrecisionPolicy
from mixprec.models.rnnlm import RNNModel
from mixprec.train.checkpoint import WEIGHTS
from mixprec.report.analyse import published_ppl, sweep_rows
from mixprec.data.wikitext import TokenWindows, batchify
from mixprec.train import step

CPU = torch.device("cpu")


def run_lm(tmp_path, *overrides):
    return run_tiny(tmp_path, *overrides, base=LM)


PRECISIONS = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))


def trainer(**values):
    values = {"log_every": 1000, **values}
    return validate(compose_config(*(f"trainer.{k}={v}" for k, v in values.items()))).trainer


def precision(name):
    """The policy of `precision=<name>`; name may carry more overrides: "o2
    precision.loss_scale=128"."""
    return PrecisionPolicy(validate(compose_config(*f"precision={name}".split())).precision, CPU)


def train_lm(
    model, policy, optimizer, schedule, train, valid, test, trainer, bptt, log=lambda row: None
):
    """The shared loop (loop.fit) with a language model's steps, as a job runs it."""
    windows = TokenWindows(train, bptt)
    loop = Loop(
        policy,
        optimizer,
        trainer,
        total_steps(trainer, len(windows)),
        log=log,
        progress=False,
    )
    steps = lm_steps.LMSteps(model, schedule, valid, test, bptt, columns=train.size(1))
    return fit(steps, windows, loop, LoopState())


def test_windows_and_targets_line_up():
    ids = torch.arange(50)
    source = batchify(ids, 3)                      # 16 rows: column j holds 16j .. 16j + 15
    windows = list(TokenWindows(source, bptt=4))
    assert [len(x) for x, _ in windows] == [4, 4, 4, 3]    # 15 targets per column
    for x, y in windows:
        # the target is the input one token later, column by column
        assert torch.equal(y, x + 1)
    assert torch.equal(torch.cat([x for x, _ in windows]), source[:-1])
    assert torch.equal(torch.cat([y for _, y in windows]), source[1:])


def test_the_hidden_state_is_cut_between_windows():
    """Every training window's incoming hidden state is a leaf (no graph back into the previous
    window), while the state it hands on does carry its own window's graph."""
    torch.manual_seed(0)
    model = RNNModel("lstm", 10, 6, 6, 2, dropout=0.0)
    seen = []
    model.rnn.register_forward_hook(
        lambda m, args, out: seen.append((args[1], out[1])) if m.training else None
    )
    policy = precision("fp32")
    optimizer = torch.optim.SGD(policy.optimizer_params(model), lr=0.1)
    source = batchify(torch.randint(10, (200,)), 4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    r = train_lm(
        model, policy, optimizer, schedule, source, source[:12], source[:12], trainer(epochs=2), 7
    )
    assert r["metrics"]["steps"] == 2 * 7 and len(seen) == 14
    for hx_in, hx_out in seen:
        assert all(h.grad_fn is None and not h.requires_grad for h in hx_in)
        assert all(h.grad_fn is not None for h in hx_out)
    # and, directly: window 2's backward leaves window 1's graph alone (it can still be
    # backpropagated once)
    x, y = next(iter(TokenWindows(source, 7)))
    loss1, _, hidden = step.lm_forward(model, x, y, model.init_hidden(4), policy)
    loss2, _, _ = step.lm_forward(model, x, y, hidden, policy)
    loss2.backward()
    loss1.backward()   # raises if loss2's backward had run through (and freed) window 1's graph


@pytest.mark.parametrize("name", ["amp", "o2", "o2 precision.loss_scale=128"])
def test_clipping_under_a_loss_scale_clips_the_unscaled_gradient(name):
    """loss = g . w with |g| = 5e-3: the scaled gradient's norm is 5e-3 x scale; clipped to 1e-3
    after unscaling, SGD at lr 1 moves w by g / 5 (clipping before unscaling would move it by g / (5
    x scale))."""
    policy = precision(name)
    w = nn.Parameter(torch.zeros(2))
    model = nn.Module()
    model.w = w
    policy.prepare_model(model)
    optimizer = torch.optim.SGD(policy.optimizer_params(model), lr=1.0)
    g = torch.tensor([3e-3, 4e-3])
    scale = policy.scale_value
    assert scale > 1
    norms = []   # the model's gradient norm after the backward, still scaled
    seen = lambda: norms.append(model.w.grad.float().norm().item())
    assert not step.backward_and_step(
        (model.w.float() * g).sum(), policy, optimizer, grad_clip=1e-3, after_backward=seen
    )
    assert norms == [pytest.approx(5e-3 * scale, rel=1e-3)]
    stepped = policy.stepped_params()[0]
    assert stepped.dtype == torch.float32 and torch.allclose(
        stepped.detach(), -g / 5, rtol=2e-3, atol=0
    )
    # in the (fp16) model too
    assert torch.allclose(model.w.detach().float(), -g / 5, rtol=2e-3, atol=0)


def test_loss_falls_on_a_repetitive_corpus():
    """A period-7 token cycle: each token determines the next, so a small LSTM gets near perplexity
    1."""
    torch.manual_seed(0)
    cycle = torch.tensor([3, 1, 4, 0, 5, 9, 2])
    source = batchify(cycle.repeat(200), 4)        # 350 rows
    model = RNNModel("lstm", 10, 16, 16, 1, dropout=0.0)
    policy = precision("fp32")
    optimizer = torch.optim.SGD(policy.optimizer_params(model), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rows = []
    r = train_lm(model, policy, optimizer, schedule, source, source[:60], source[60:120],
                 trainer(epochs=6, log_every=25, grad_clip=1.0), 7, log=rows.append)
    losses = [row["loss"] for row in rows if row["kind"] == "train"]
    assert r["metrics"]["steps"] == 6 * 50 and r["status"] == "completed"
    assert losses[0] > 1.5 and losses[-1] < 0.1 * losses[0]     # ln 10 = 2.3 at the start
    assert r["metrics"]["final_valid_ppl"] < 1.2 and r["metrics"]["final_test_ppl"] < 1.2


class Fixed(nn.Module):
    """A 'model' whose next-token distribution puts probability q[x] on x + 1 and spreads the rest
    evenly."""

    def __init__(self, q, vocab):
        super().__init__()
        self.q, self.vocab = q, vocab
        self.decoder = nn.Linear(1, vocab)   # init_hidden's dtype and device

    def init_hidden(self, batch):
        return torch.zeros(1, batch, 1)

    def forward(self, x, hidden):
        p = ((1 - self.q[x]) / (self.vocab - 1)).unsqueeze(-1).expand(*x.shape, self.vocab).clone()
        p.scatter_(-1, (x + 1).unsqueeze(-1), self.q[x].unsqueeze(-1))
        return p.log(), hidden


def test_perplexity_is_exp_of_the_mean_loss_per_token():
    vocab = 30
    q = torch.linspace(0.05, 0.9, vocab)
    # 14 rows, targets x + 1; windows of 5, 5, 3 rows
    source = batchify(torch.arange(29), 2)
    policy = precision("fp32")
    loss = lm_steps.evaluate(Fixed(q, vocab), source, 5, policy)
    # every input that has a target, each counted once
    targets_from = source[:-1].flatten()
    expected = -torch.log(q[targets_from].double()).mean().item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert lm_steps.perplexity(loss) == pytest.approx(math.exp(expected), rel=1e-6)
    uniform = Fixed(torch.full((vocab,), 1 / vocab), vocab)
    assert lm_steps.perplexity(lm_steps.evaluate(uniform, source, 5, policy)) == pytest.approx(
        vocab, rel=1e-5
    )
    assert lm_steps.perplexity(1e4) == math.inf and math.isnan(lm_steps.perplexity(math.nan))


def test_what_cpu_autocast_does_with_the_recurrent_layers():
    """As the README says (torch 2.14): under CPU autocast the LSTM and GRU run in fp32 (oneDNN's
    fp16 LSTM, which autocast would pick, is turned off), nn.RNN and the decoder in fp16, the
    embedding in fp32. (precision.emulate =false: the CPU's own autocast; emulated, CUDA's policy
    applies: the next test.)"""
    policy = precision("amp precision.emulate=false")
    for kind, rnn_dtype in (
        ("lstm", torch.float32),
        ("gru", torch.float32),
        ("rnn_tanh", torch.float16),
    ):
        model = RNNModel(kind, 20, 8, 8, 2)
        seen, loss = dtypes_seen(model, policy)
        assert seen == {"encoder": torch.float32, "rnn": rnn_dtype, "decoder": torch.float16}, kind
        # oneDNN back on afterwards
        assert loss.dtype == torch.float32 and torch.backends.mkldnn.enabled


def dtypes_seen(model, policy) -> tuple[dict, torch.Tensor]:
    """The output dtypes of the model's embedding, recurrent layers and decoder in one window and
    backward."""
    seen = {}
    for part in ("encoder", "rnn", "decoder"):
        getattr(model, part).register_forward_hook(
            lambda m, args, out, part=part: seen.__setitem__(
                part, (out[0] if part == "rnn" else out).dtype
            )
        )
    x = torch.randint(20, (5, 3))
    loss, _, _ = step.lm_forward(model, x, x, model.init_hidden(3), policy)
    loss.backward()
    return seen, loss


def test_emulated_cuda_autocast_with_the_recurrent_layers():
    """Emulated (CUDA's policy): every RNN kind runs in fp16 under amp (cuDNN's autocast cast), in
    fp32 under amp_bf16 (the policy tells RNNModel to run it outside autocast, as on a GPU); the
    decoder in the autocast dtype."""
    for name, rnn_dtype, dec in (
        ("amp", torch.float16, torch.float16),
        ("amp_bf16", torch.float32, torch.bfloat16),
    ):
        policy = precision(name)
        assert policy.emulated
        for kind in ("lstm", "gru", "rnn_tanh"):
            with emulation.numerics(True):
                model = policy.prepare_model(RNNModel(kind, 20, 8, 8, 2))
                seen, _ = dtypes_seen(model, policy)
            assert seen == {"encoder": torch.float32, "rnn": rnn_dtype, "decoder": dec}, (
                name,
                kind,
            )
            assert model.rnn_dtype == rnn_dtype


def test_the_policy_decides_where_the_recurrent_layers_run_and_the_model_only_obeys():
    """The bf16 cuDNN-RNN rule is the precision policy's: outside autocast under CUDA autocast to
    bf16, real (a CUDA device) or emulated, nowhere else; the model runs what it is told, whatever
    autocast it finds (told nothing, it leaves the RNN to emulated bf16 autocast: cuDNN's fp16)."""
    cuda = torch.device("cuda")   # no GPU needed: the policy's decision reads the device's type
    told = {
        (name, device.type): PrecisionPolicy(
            validate(compose_config(*f"precision={name}".split())).precision, device
        ).rnn_outside_autocast
        for name in ("fp32", "amp", "amp_bf16", "amp_bf16 precision.emulate=false", "bf16")
        for device in (CPU, cuda)
    }
    assert {k for k, outside in told.items() if outside} == {
        ("amp_bf16", "cpu"),
        ("amp_bf16", "cuda"),
        ("amp_bf16 precision.emulate=false", "cuda"),
    }
    policy = precision("amp_bf16")
    with emulation.numerics(True):
        model = RNNModel("gru", 20, 8, 8, 2)
        assert not model.rnn_outside_autocast
        seen, _ = dtypes_seen(model, policy)
        assert seen["rnn"] == torch.float16   # not told: autocast's cuDNN RNN cast
        assert policy.prepare_model(model).rnn_outside_autocast
        assert dtypes_seen(model, policy)[0]["rnn"] == torch.float32


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.slow
def test_every_precision_trains_every_rnn_kind(tmp_path, kind):
    torch.manual_seed(0)   # the run's seed, set just before its model is built: its initial weights
    initial = RNNModel(kind, 40, 8, 8, 2).state_dict()
    for name in PRECISIONS:
        s = run_lm(tmp_path / name, f"model={kind}", f"precision={name}")
        m = s["metrics"]
        assert s["status"] == "completed", (name, s.get("error") or s.get("reason"))
        assert (
            m["steps"] == 2 and m["tokens"] == 2 * 4 * 6 and m["throughput_unit"] == "tokens/s"
        ), name
        assert 1 < m["final_valid_ppl"] < 1e3 and math.isfinite(m["final_test_ppl"]), name
        assert (m["loss_scale"] is not None) == (
            s["config"]["precision"]["loss_scale"] != "none"
        ), name
        weights = torch.load(tmp_path / name / WEIGHTS, weights_only=True)
        assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point()), (
            name
        )
        assert weights.keys() == initial.keys()
        # the embedding rows of words not seen in the 2 windows are the initial ones (up to the
        # dtype's rounding)
        assert (
            torch.isclose(weights["encoder.weight"], initial["encoder.weight"], atol=1e-3)
            .all(1)
            .any()
        ), name
        # trained
        assert not torch.equal(weights["decoder.weight"], initial["decoder.weight"]), name
        assert not torch.equal(weights["rnn.weight_hh_l0"], initial["rnn.weight_hh_l0"]), name


def test_a_job_records_perplexity_anneals_the_lr_and_saves_fp32_weights(tmp_path):
    s = run_lm(
        tmp_path,
        "precision=apex_fp16",
        "model.tied=true",
        "trainer.max_steps=null",
        "trainer.epochs=3",
        "optimizer.lr=40",
        "schedule.factor=4",
    )
    m = s["metrics"]
    assert s["status"] == "completed" and m["steps"] == 3 * m["steps_per_epoch"] == 3 * math.ceil(
        (300 - 1) / 6
    )
    assert (
        m["loss_scale"] == {"min": 128.0, "max": 128.0, "final": 128.0} and m["skipped_steps"] == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [e["valid_ppl"] for e in epochs] == [
        pytest.approx(math.exp(e["valid_loss"])) for e in epochs
    ]
    best = min(epochs, key=lambda e: e["valid_loss"])
    assert (
        m["best_valid_ppl"] == best["valid_ppl"] and m["test_ppl_at_best_valid"] == best["test_ppl"]
    )
    assert (
        m["final_valid_ppl"] == epochs[-1]["valid_ppl"]
        and m["final_test_ppl"] == epochs[-1]["test_ppl"]
    )
    lr = 40.0
    # the example's rule: divided by 4 after each epoch whose validation loss is no better
    for e in epochs:
        assert e["lr"] == lr
        assert e["annealed"] == (
            e["epoch"] > 1
            and e["valid_loss"] >= min(x["valid_loss"] for x in epochs[: e["epoch"] - 1])
        )
        lr = lr / 4 if e["annealed"] else lr
    assert m["final_lr"] == lr
    assert (
        m["train_flops_per_sample"] == 3 * m["forward_flops_per_sample"]
        and m["flops_per"] == "token"
    )
    weights = torch.load(tmp_path / WEIGHTS, weights_only=True)
    assert s["weights"] == {"file": WEIGHTS, "dtype": "float32", "num_classes": 40}
    # tied: both names hold the fp32 master (not the fp16 copy rounded from it)
    assert weights["encoder.weight"].dtype == torch.float32
    assert torch.equal(weights["encoder.weight"], weights["decoder.weight"])
    assert not torch.equal(weights["encoder.weight"], weights["encoder.weight"].half().float())


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=lstm"], "model=lstm is a language model: it needs a text dataset"),
        (
            ["dataset=synthetic_text"],
            "dataset=synthetic_text is a text corpus: it trains a language model",
        ),
        (["schedule=plateau"], "schedule=plateau anneals on a validation loss"),
        (
            ["model=lstm", "dataset=synthetic_text", "trainer.target_acc=0.5"],
            "trainer.target_acc: a language model is",
        ),
    ],
)
def test_a_model_and_data_of_different_tasks_is_one_config_error(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as e:
        # config validation: before any data or model
        run_tiny(tmp_path, *overrides, base=["logger=none"])
    assert e.value.code == 2
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["error"].startswith(f"config error: {message}") and "traceback" not in s


@pytest.mark.parametrize("override,field", [
    ("model.tied=true", "model.tied=true: needs model.emsize == model.nhid (got 200 and 300)"),
    ("model.dropout=1.0", "model.dropout=1.0: must be in [0, 1)"),
    ("schedule.factor=1", "schedule.factor=1.0: must be a number > 1"),
])
def test_bad_language_model_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        validate(compose_config("model=lstm", "schedule=plateau", "model.nhid=300", override))
    assert str(e.value).startswith(field)


def test_published_numbers_sit_beside_apex_runs_only():
    config = validate(compose_config("experiment=apex_word_lm_readme", "precision=apex_fp16"))
    summary = {
        "choices": {"precision": "apex_fp16", "dataset": "wikitext2", "model": "lstm"},
        "config": {
            "model": vars(config.model),
            "trainer": {"batch_size": 24, "epochs": 30},
            "precision": vars(config.precision),
        },
        "metrics": {"test_ppl_at_best_valid": 91.5},
    }
    # the README's converged value, at loss scale 128
    assert published_ppl(summary) == "90 (40 epochs)"
    summary["config"]["precision"] = {**summary["config"]["precision"], "loss_scale": 1.0}
    assert published_ppl(summary) == "93 (40 epochs)"
    summary["config"]["precision"] = {**summary["config"]["precision"], "loss_scale": 512.0}
    assert published_ppl(summary) is None
    summary["choices"]["precision"] = "amp"
    summary["config"]["precision"] = vars(validate(compose_config("precision=amp")).precision)
    assert published_ppl(summary) is None
    row = sweep_rows([summary])[0]
    assert row["lm"] and row["test_ppl"] == 91.5


def test_plateau_divides_the_lr_after_each_epoch_without_a_better_validation_loss():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=20.0)
    schedule = build_schedule(validate(compose_config("schedule=plateau")).schedule, optimizer, 100)
    lrs = []
    for valid_loss in (5.0, 4.0, 4.0, 4.5, 3.9, 3.95, 3.8):
        schedule.step(valid_loss)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == [20.0, 20.0, 5.0, 1.25, 1.25, 0.3125, 0.3125]


@pytest.mark.slow   # a subprocess sweep
def test_apex_word_lm_sweep_runs_every_job_and_prints_the_table(tmp_path):
    sweep = tmp_path / "sweep"
    small = [
        "dataset=synthetic_text",
        "dataset.vocab_size=40",
        "dataset.train_size=1200",
        "dataset.test_size=200",
        "dataset.bptt=6",
        "model.emsize=16",
        "model.nhid=16",
        "trainer.batch_size=4",
        "trainer.max_steps=2",
        "trainer.device=cpu",
    ]   # the table marks the CPU's fp16 jobs emulated
    r = run_cli("-m", "experiment=apex_word_lm", *small, "logger=none", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted(s["choices"]["precision"] for s in summaries) == ["amp", "apex_fp16_2018", "fp32"]
    for s in summaries:   # the fastai article's run: apex main.py@28bdc04e's defaults
        c = s["config"]
        assert s["status"] == "completed" and s["metrics"]["steps"] == 2
        assert (
            c["model"]["arch"],
            c["model"]["nlayers"],
            c["model"]["dropout"],
            c["model"]["vocab_multiple"],
        ) == ("lstm", 2, 0.2, 1)
        assert (
            c["optimizer"]["lr"],
            c["optimizer"]["momentum"],
            c["trainer"]["grad_clip"],
            c["schedule"]["name"],
            c["trainer"]["epochs"],
            c["trainer"]["batch_size"],
        ) == (20.0, 0.0, 0.25, "plateau", 30, 4)
    assert {
        s["choices"]["precision"]: s["config"]["precision"]["loss_scale"] for s in summaries
    } == {"fp32": "none", "apex_fp16_2018": 1.0, "amp": "dynamic"}
    out = r.stdout[r.stdout.index(f"sweep {sweep}: 3 jobs"):].splitlines()
    header = out[1].split()
    assert header[:7] == ["job", "model", "precision", "status", "epochs", "time", "s"]
    assert (
        "tokens/s" in header and "valid" in header and "published" in header and "acc" not in header
    )
    rows = {line.split()[2]: line.split() for line in out[3:6]}
    # the static loss scale is shown, and the CPU's fp16 jobs are marked emulated (no speed-up shown
    # for them)
    assert sorted(rows) == ["amp(emulated)", "apex_fp16_2018(x1)(emulated)", "fp32"]
    rows["apex_fp16_2018"] = rows.pop("apex_fp16_2018(x1)(emulated)")
    rows["amp"] = rows.pop("amp(emulated)")
    # cells: job, model, precision, status, epochs, time s, tokens/s, batch, compile, GPU busy, vs
    # fp32, MFU, valid ppl, test ppl, dloss vs fp32, published test ppl, peak MB
    # batch, compile, no busy figure (CPU)
    assert all(cells[7:10] == ["4", "none", "-"] for cells in rows.values())
    assert rows["amp"][10] == "-" and rows["apex_fp16_2018"][10] == "-"
    by_precision = {s["choices"]["precision"]: s for s in summaries}
    for name, cells in rows.items():
        m = by_precision[name]["metrics"]
        assert cells[3] == "completed" and f"{m['test_ppl_at_best_valid']:.2f}" in cells
    # not apex's model
    assert rows["fp32"][10] == "1.00" and all(cells[15] == "-" for cells in rows.values())
    # loss gap; no MFU on a CPU
    assert rows["fp32"][14] == "+0" and all(cells[11] == "-" for cells in rows.values())
    assert out[6].startswith("published test ppl: NVIDIA apex's word_language_model README")
    assert out[7].startswith("(emulated): fp16/bf16 rounding emulated on fp32 kernels")


def test_generate_samples_words_from_a_trained_run(tmp_path, capsys):
    generate = load_script("generate")
    run = tmp_path / "run"
    run_lm(run, "model=gru", "precision=amp")
    capsys.readouterr()
    assert generate.main([str(run), "--words", "45", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    vocab = {"<eos>"} | {f"w{i}" for i in range(1, 40)}
    assert [len(line.split()) for line in lines] == [20, 20, 5] and set(text.split()) <= vocab
    assert (
        generate.main([str(run), "--words", "45", "--seed", "3", "--out", str(tmp_path / "a.txt")])
        == 0
    )
    assert (tmp_path / "a.txt").read_text() == text
    assert generate.main([str(run), "--words", "45", "--seed", "4"]) == 0
    assert capsys.readouterr().out != text
    image = tmp_path / "image"
    run_tiny(image)
    capsys.readouterr()
    assert generate.main([str(image)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"generate: {image}: model=small_cnn is not a language model (lstm, gru, rnn_tanh, "
           "rnn_relu, gpt)"
    )


# -- cuDNN's one chunk of RNN weights --------------------------------------------------------------

def flatten_callers(monkeypatch) -> list[set]:
    """Patch nn.RNNBase.flatten_parameters (a no-op on the CPU) to record, per call, the names of
    the functions on the stack above it: where a GPU job would have compacted its RNN weights."""
    import sys

    calls = []
    flatten = nn.RNNBase.flatten_parameters

    def counted(self):
        frame, names = sys._getframe(1), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        calls.append(names)
        return flatten(self)

    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", counted)
    return calls


def flattened_in(calls: list[set], point: str) -> bool:
    return any(point in c and "flatten_rnns" in c for c in calls)


# half: a dtype change (emulated on the CPU)
@pytest.mark.parametrize("precision", ["fp32", "half"])
def test_rnn_weights_are_compacted_after_the_dtype_change_and_prewarms_copy(
    tmp_path, monkeypatch, precision
):
    calls = flatten_callers(monkeypatch)
    s = run_tiny(
        tmp_path, f"precision={precision}", "trainer.prewarm_steps=1", "trainer.device=cpu", base=LM
    )
    assert s["status"] in ("completed", "diverged"), s.get("error")
    assert flattened_in(calls, "prepare_model")
    assert flattened_in(calls, "run_prewarm")   # deepcopy made the copy's weights separate tensors


@pytest.mark.parametrize("emulate", [False, True])
def test_rnn_weights_are_compacted_after_a_checkpoint_load(tmp_path, monkeypatch, emulate):
    from mixprec.train.checkpoint import Checkpointer

    with emulation.numerics(emulate):
        models = [RNNModel("lstm", 20, 8, 8, 2) for _ in range(2)]
        if emulate:
            models = [m.half() for m in models]
        saver = Checkpointer(tmp_path, meta={})
        saver.parts["model"] = models[0]
        state = LoopState()
        saver.save(state)
    # as checkpoint.read: before the numerics
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    calls = flatten_callers(monkeypatch)
    with emulation.numerics(emulate):
        saver.parts["model"] = models[1]
        saver.restore(ckpt, state)
    assert flattened_in(calls, "restore")
    assert all(
        torch.equal(a, b)
        for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values())
    )
