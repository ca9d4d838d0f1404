"""Every option of every group composes and validates; bad values fail with one line naming the
field."""
import pytest

from helpers import CONF, compose_config
from mixprec.config import ConfigError, validate

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_groups_are_the_designed_ones():
    assert {"model", "dataset", "precision", "gpu", "optimizer", "schedule", "trick", "logger",
            "experiment"} <= set(GROUPS)
    assert set(options("precision")) == {
        "fp32",
        "tf32",
        "amp",
        "amp_bf16",
        "half",
        "bf16",
        "o0",
        "o1",
        "o2",
        "o3",
        "fastai_fp16",
        "apex_fp16",
        "apex_fp16_2018",
        "fp8",
        "mxfp8",
    }
    assert {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"} <= set(options("model"))
    assert {"auto", "h100", "a100", "v100", "rtx2080ti", "gtx1080ti"} <= set(options("gpu"))


def option_params():
    """Every option of every group: the quick loop composes every precision mode and the first
    option of each other group; the rest is slow (a composition each, about 0.3 s on 2 cores)."""
    return [(g, o) if g == "precision" or o == options(g)[0]
            else pytest.param(g, o, marks=pytest.mark.slow)
            for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", option_params())
def test_every_option_composes_and_validates(group, option):
    cfg = compose_config(f"{group}={option}")
    assert cfg.hydra.runtime.choices[group] == option
    config = validate(cfg)
    # experiment and pitfall options are global presets, not a config section
    if hasattr(config, group):
        section = getattr(config, group)
        assert getattr(section, "name", getattr(section, "arch", None)) is not None


@pytest.mark.slow
def test_precision_table_semantics():
    p = {o: validate(compose_config(f"precision={o}")).precision for o in options("precision")}
    assert not p["fp32"].tf32 and p["tf32"].tf32
    assert p["amp"].autocast_dtype == "float16" and p["amp"].loss_scale == "dynamic"
    assert p["amp_bf16"].autocast_dtype == "bfloat16" and p["amp_bf16"].loss_scale == "none"
    assert (
        p["half"].param_dtype == "float16"
        and not p["half"].keep_bn_fp32
        and not p["half"].master_weights
    )
    assert p["o2"].param_dtype == "float16" and p["o2"].keep_bn_fp32 and p["o2"].master_weights
    assert p["o2"].loss_scale == "dynamic"
    assert (
        p["fp8"].fp8_recipe == "tensorwise"
        and p["fp8"].autocast_dtype == "bfloat16"
        and p["fp8"].loss_scale == "none"
    )
    assert (
        p["mxfp8"].fp8_recipe == "mxfp8"
        and p["mxfp8"].autocast_dtype == "bfloat16"
        and p["mxfp8"].param_dtype == "float32"
        and p["mxfp8"].loss_scale == "none"
    )
    assert all(p[o].fp8_recipe is None for o in p if o not in ("fp8", "mxfp8"))
    assert p["o1"].autocast_dtype == "float16" and p["o0"].param_dtype == "float32"
    assert p["o3"].param_dtype == "float16" and not p["o3"].master_weights


@pytest.mark.parametrize("override,field", [
    ("trainer.batch_size=0", "trainer.batch_size=0"),
    ("optimizer.lr=-0.1", "optimizer.lr=-0.1"),
    ("precision.loss_scale=banana", "precision.loss_scale='banana'"),
    ("precision.loss_scale=-4", "precision.loss_scale=-4"),
    ("trainer.on_nonfinite=explode", "trainer.on_nonfinite='explode'"),
    ("trainer.epochs=1.5", "trainer.epochs=1.5"),
    ("+trainer.bogus=1", "trainer.bogus"),
    ("dataset.num_classes=7", "dataset.num_classes=7"),
    ("trainer.target_acc=94", "trainer.target_acc=94"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(override))
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg


def test_half_with_adam_is_allowed_it_is_a_pitfall_not_an_error():
    config = validate(compose_config("precision=half", "optimizer=adam"))
    assert config.optimizer.eps == 1e-8 and config.precision.param_dtype == "float16"


def test_dynamic_scale_needs_fp32_gradients():
    with pytest.raises(ConfigError, match="master_weights"):
        validate(compose_config("precision=half", "precision.loss_scale=dynamic"))
    assert (
        validate(compose_config("precision=half", "precision.loss_scale=128")).precision.loss_scale
        == 128.0
    )


def test_a_data_folder_does_not_name_the_job_dir():
    """`dataset.data_dir=/data` (the docs' commands) stays out of the sweep's job dir names: its '/'
    would nest each job's dir under folders named after the path, where the end-of-sweep table does
    not look."""
    hydra = compose_config("dataset=cifar10", "dataset.data_dir=/data/cifar", "precision=amp").hydra
    assert hydra.job.override_dirname == "dataset=cifar10,precision=amp"
