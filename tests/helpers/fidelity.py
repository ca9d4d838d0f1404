"""The fidelity tests' (tests/fidelity/) reading of a composed preset: the validated config and a
summary-like dict, a dotted key's value, and a table of (key, value, source) checked at once."""
from helpers import compose_config
from mixprec.config import plain_config, validate


def composed(*overrides):
    """(validated config, a summary-like dict with the group choices and the resolved config) of a
    composed job."""
    cfg = compose_config(*overrides)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    return validate(cfg), {"choices": choices, "config": plain_config(cfg), "name": cfg.name}


def get(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def check_table(config, table):
    wrong = [
        (key, get(config, key), want, where)
        for key, want, where in table
        if get(config, key) != want
    ]
    assert not wrong, wrong

