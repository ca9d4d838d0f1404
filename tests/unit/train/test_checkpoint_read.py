"""checkpoint.read: what the weights-only unpickler is told of, and what it says when it refuses."""
import pytest
import torch

from mixprec.train import checkpoint
from mixprec.train.checkpoint import CHECKPOINT, CheckpointError
from mixprec.train.optim import TORCHAO_STATES

torchao_optim = pytest.importorskip("torchao.optim")


@pytest.fixture
def new_process_allow_list():
    """The weights-only allow-list as a new process has it (no torchao import yet)."""
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adamw_fp8"])
def test_a_low_bit_optimizers_checkpoint_loads_in_a_process_that_never_imported_torchao(
    tmp_path, new_process_allow_list, name
):
    """The reader names the optimizer's state classes itself: torchao allows them only as a side
    effect of an import the resumed job has not made yet."""
    path = tmp_path / CHECKPOINT
    module, cls = TORCHAO_STATES[name]
    state = getattr(getattr(torchao_optim, module), cls).zeros((4096,))
    torch.save({"exp_avg": state}, path)
    assert type(checkpoint.load(path, name)["exp_avg"]).__name__ == cls
    with pytest.raises(Exception, match="Unsupported global"):
        checkpoint.load(path, "adamw")


@pytest.mark.parametrize("installed", [True, False])
def test_a_checkpoint_of_a_class_it_cannot_load_is_named_and_not_called_broken(
    tmp_path, new_process_allow_list, monkeypatch, installed
):
    """One line that names the class (not the unpickler's banner, nor its escape codes) and says
    the file is intact: deleting it would lose a pre-empted run. With torchao installed the class
    is a low-bit optimizer's state under a config that names another optimizer (a changed
    config); without it, torchao is missing."""
    import importlib.util

    path = tmp_path / CHECKPOINT
    torch.save({"exp_avg": torchao_optim.subclass_8bit.OptimState8bit.zeros((4096,))}, path)
    if not installed:
        find = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "torchao" else find(name, *a))
    with pytest.raises(CheckpointError) as e:
        checkpoint.read(tmp_path, {"optimizer": {"name": "adamw"}}, "cpu")
    line = str(e.value)
    assert "\n" not in line and "\x1b" not in line
    assert line.startswith(f"{path}: not a readable checkpoint (WeightsUnpickler error: "
                           "Unsupported global: GLOBAL torchao.optim.subclass_8bit.OptimState8bit)")
    assert ("it is intact, and holds a torchao low-bit optimizer's state while this job's config "
            "names optimizer=adamw: resume with the job's own overrides" in line) is installed
    assert ("it is intact: install the package that class comes from" in line) is not installed
