"""CIFAR-10/100 from tiny files in the official formats: folder and .tar.gz, cache, download,
errors."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from hydra.core.hydra_config import HydraConfig

from helpers import TINY, compose_config, run_cli
from helpers.expected import small_cnn_flops
from helpers.official_formats import (
    cifar_files,
    FOLDERS,
    py2_pickle,
    Serve,
    UNREACHABLE,
    write_cifar,
)
from mixprec.data import cifar
from mixprec.config import ConfigError, validate
from mixprec.data import build_image_data
from mixprec.data.files import DataError


def dataset(name, root, *more):
    return validate(compose_config(f"dataset={name}", f"dataset.data_dir={root}", *more)).dataset


def load(name, root, *more):
    return build_image_data(dataset(name, root, "dataset.download=false", *more))


def float_stats(x: np.ndarray):
    f = x.astype(np.float64) / 255
    return f.mean(axis=(0, 2, 3)), f.std(axis=(0, 2, 3), ddof=1)


@pytest.mark.parametrize("form", ["folder", "tar"])
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_official_format_loads_exactly(tmp_path, name, form):
    expect = write_cifar(tmp_path, name, form)
    data = load(name, tmp_path)
    assert data.train_x.dtype == torch.uint8 and data.train_y.dtype == torch.int64
    assert data.train_x.shape == (12 if name == "cifar10" else 7, 3, 32, 32)
    for key in ("train_x", "train_y", "test_x", "test_y"):
        assert np.array_equal(getattr(data, key).numpy(), expect[key]), key
    assert list(data.classes) == expect["classes"] and data.num_classes == len(expect["classes"])
    if name == "cifar100":
        assert np.array_equal(data.train_coarse.numpy(), expect["train_coarse"])
        assert np.array_equal(data.test_coarse.numpy(), expect["test_coarse"])
        assert list(data.coarse_classes) == expect["coarse_classes"]
        assert data.test_coarse.dtype == torch.int64
    else:
        assert data.train_coarse is None
    mean, std = float_stats(expect["train_x"])
    assert data.mean == pytest.approx(tuple(mean), abs=1e-12) and data.std == pytest.approx(
        tuple(std), abs=1e-12
    )
    assert data.info["cache"] == "written"
    again = load(name, tmp_path)   # the second run reads the .npy cache: the same arrays
    assert again.info["cache"] == "hit" and torch.equal(again.train_x, data.train_x)
    assert (
        torch.equal(again.test_y, data.test_y)
        and again.mean == data.mean
        and again.classes == data.classes
    )


def test_one_pixel_lands_where_the_format_says(tmp_path):
    """Row layout: 1024 red values, then green, then blue, each a row-major 32x32 plane."""
    row = np.zeros((1, 3072), np.uint8)
    row[0, 1024 + 32 * 5 + 7] = 200            # green, y=5, x=7
    files, _ = cifar_files("cifar10")
    files["data_batch_1"] = py2_pickle(
        {b"batch_label": b"b", b"labels": [3], b"data": row, b"filenames": [b"a"]}
    )
    write_cifar(tmp_path, "cifar10", files=files)
    x = load("cifar10", tmp_path).train_x[0]
    assert x[1, 5, 7] == 200 and int(x.sum()) == 200


def test_the_cache_follows_its_sources(tmp_path):
    write_cifar(tmp_path, "cifar10", seed=0)
    first = load("cifar10", tmp_path)
    expect = write_cifar(tmp_path, "cifar10", seed=1)     # new files in place of the old ones
    second = load("cifar10", tmp_path)
    assert second.info["cache"] == "written" and np.array_equal(
        second.train_x.numpy(), expect["train_x"]
    )
    assert not torch.equal(first.train_x, second.train_x)
    manifest = json.loads((tmp_path / "mixprec-cache" / "cifar10" / "manifest.json").read_text())
    assert sorted(manifest["arrays"]) == ["test_x", "test_y", "train_x", "train_y"]
    # no temporary files left
    assert not list((tmp_path / "mixprec-cache" / "cifar10").glob(".*"))


def test_a_truncated_archive_names_the_file_and_leaves_no_cache(tmp_path):
    write_cifar(tmp_path, "cifar10", form="tar")
    archive = tmp_path / FOLDERS["cifar10"][1]
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        load("cifar10", tmp_path)
    assert (
        str(archive) in str(e.value)
        and "truncated or corrupt" in str(e.value)
        and "\n" not in str(e.value)
    )
    cache = tmp_path / "mixprec-cache"
    assert not cache.exists() or not any(cache.rglob("*"))


def test_a_corrupt_file_in_the_folder_names_that_file(tmp_path):
    write_cifar(tmp_path, "cifar100")
    bad = tmp_path / "cifar-100-python" / "test"
    bad.write_bytes(bad.read_bytes()[:5000])
    with pytest.raises(DataError, match="cifar-100-python/test: .*truncated or corrupt"):
        load("cifar100", tmp_path)
    assert not (tmp_path / "mixprec-cache").exists()


@pytest.mark.parametrize(
    "name,file,entry,msg",
    [
        ("cifar10", "data_batch_2", {b"labels": [0, 10]}, "'labels' must be in 0..9, found 0..10"),
        (
            "cifar10",
            "test_batch",
            {b"data": np.zeros((2, 3000), np.uint8)},
            r"'data' must be uint8 \[N, 3072\]",
        ),
        ("cifar10", "data_batch_1", {b"labels": [1]}, "'labels' must be 2 integer labels"),
        (
            "cifar100",
            "train",
            {b"coarse_labels": [20, 0]},
            "'coarse_labels' must be in 0..19, found 0..20",
        ),
    ],
)
def test_wrong_labels_or_shapes_are_named(tmp_path, name, file, entry, msg):
    base = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"fine_labels": [0, 1],
            b"coarse_labels": [0, 1], b"batch_label": b"x", b"filenames": [b"a", b"b"]}
    write_cifar(tmp_path, name, files={file: py2_pickle({**base, **entry})})
    with pytest.raises(DataError, match=f"{file}: {msg}"):
        load(name, tmp_path)


def test_something_other_than_data_in_a_pickle_is_refused(tmp_path):
    files, _ = cifar_files("cifar10")
    files["batches.meta"] = py2_pickle({b"label_names": print})
    write_cifar(tmp_path, "cifar10", files=files)
    with pytest.raises(DataError, match="batches.meta: .*refusing to load .*print"):
        load("cifar10", tmp_path)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_offline_and_missing_says_where_what_and_how(tmp_path, name):
    title = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}[name]
    with pytest.raises(DataError) as e:
        build_image_data(dataset(name, tmp_path, f"dataset.urls=[{UNREACHABLE}{FOLDERS[name][1]}]"))
    msg = str(e.value)
    folder, archive = FOLDERS[name]
    assert (
        msg.startswith(f"{title} not found in {tmp_path}: expected {folder}/ with ")
        and "\n" not in msg
    )
    assert all(f in msg for f in cifar.SPECS[name].files) and archive in msg
    assert cifar.SPECS[name].url in msg and "dataset=synthetic" in msg and "MIXPREC_DATA_DIR" in msg
    assert "the download failed" in msg and "Connection refused" in msg
    assert [p.name for p in tmp_path.iterdir()] == []     # no partial download left behind
    (tmp_path / folder).mkdir()
    (tmp_path / folder / cifar.SPECS[name].test_files[0]).write_bytes(b"")
    with pytest.raises(
        DataError, match=f"{folder}/ is there but lacks .*; dataset.download=false. Get "
    ):
        load(name, tmp_path)


def test_download_checks_the_md5_then_extracts(tmp_path, monkeypatch):
    served = tmp_path / "served"
    expect = write_cifar(served, "cifar100", form="tar")
    archive = FOLDERS["cifar100"][1]
    root = tmp_path / "data"
    with Serve(served) as url:
        # the published md5 is not this tiny archive's: refused, nothing kept
        with pytest.raises(
            DataError,
            match=f"{url}{archive}: ValueError: md5 [0-9a-f]+ is not the published "
            f"{cifar.SPECS['cifar100'].md5}",
        ):
            build_image_data(dataset("cifar100", root, f"dataset.urls=[{url}{archive}]"))
        assert not root.exists() or list(root.iterdir()) == []
        # with its own md5 published, the first URL that works is used, checked, extracted and
        # loaded
        from mixprec.data.files import md5sum
        spec = dataclasses.replace(cifar.SPECS["cifar100"], md5=md5sum(served / archive))
        monkeypatch.setitem(cifar.SPECS, "cifar100", spec)
        data = build_image_data(
            dataset("cifar100", root, f"dataset.urls=[{UNREACHABLE}x,{url}{archive}]")
        )
    assert (root / archive).read_bytes() == (served / archive).read_bytes()
    assert sorted(p.name for p in (root / "cifar-100-python").iterdir()) == [
        "meta",
        "readme.html",
        "test",
        "train",
    ]
    assert np.array_equal(data.train_x.numpy(), expect["train_x"]) and data.info["source"].endswith(
        "cifar-100-python"
    )


def test_data_dir_comes_from_the_environment_when_not_set(tmp_path, monkeypatch):
    expect = write_cifar(tmp_path, "cifar10")
    monkeypatch.setenv("MIXPREC_DATA_DIR", str(tmp_path))
    data = build_image_data(
        validate(compose_config("dataset=cifar10", "dataset.download=false")).dataset
    )
    assert data.info["source"] == str(tmp_path / "cifar-10-batches-py")
    assert np.array_equal(data.test_y.numpy(), expect["test_y"])


@pytest.mark.parametrize("override,msg", [
    ("dataset.train_size=100", "dataset.train_size=100: only synthetic data has a size"),
    ("dataset.num_classes=100", "dataset.num_classes=100: cifar10 has 10 classes"),
    ("dataset.cutout=40", "dataset.cutout=40: must be at most dataset.image_size=32"),
    ("dataset.pipeline=gpu", "dataset.pipeline='gpu': allowed values are device, dataloader"),
])
def test_bad_dataset_values_name_the_field(override, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(compose_config("dataset=cifar10", override))


SMALL = [o for o in TINY if not o.startswith("dataset.")]


def run_job_with(tmp_path, *overrides):
    from mixprec.job import run_job
    cfg = compose_config(*SMALL, *overrides, output_dir=tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    return run_job(cfg)


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_a_job_trains_on_cifar_files(tmp_path, pipeline):
    write_cifar(tmp_path / "data", "cifar100", form="tar")
    s = run_job_with(
        tmp_path,
        "dataset=cifar100",
        f"dataset.data_dir={tmp_path / 'data'}",
        "trainer.batch_size=4",
        "trainer.max_steps=null",
        "trainer.epochs=2",
        f"dataset.pipeline={pipeline}",
        "dataset.workers=0",
        "dataset.image_size=16",
        "dataset.cutout=4",
    )
    assert s["status"] == "completed" and s["metrics"]["steps"] == 2 * (7 // 4)
    assert s["data"]["train"] == 7 and s["data"]["test"] == 4 and s["data"]["cache"] == "written"
    assert s["data"]["source"] == str(tmp_path / "data" / "cifar-100-python.tar.gz")
    assert s["metrics"]["forward_flops_per_sample"] == pytest.approx(
        small_cnn_flops(8, classes=100, side=16), rel=0.01
    )


def test_text_data_in_train_py_is_a_clear_config_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        run_job_with(tmp_path, "dataset=synthetic_text")
    assert e.value.code == 2   # a config error, as every other one (tests/jobs/test_cli.py)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (
        s["error"].startswith(
            "config error: dataset=synthetic_text is a text corpus: it trains a language model "
            "(model=lstm"
        )
        and "traceback" not in s
    )


@pytest.mark.slow
def test_cli_offline_and_missing_is_one_line_and_a_non_zero_exit(tmp_path):
    r = run_cli(
        "dataset=cifar10",
        f"dataset.data_dir={tmp_path / 'data'}",
        f"dataset.urls=[{UNREACHABLE}a.tar.gz]",
        "model=small_cnn",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("mixprec: the job failed")]
    assert len(errors) == 1 and errors[0].startswith(
        "mixprec: the job failed: data error: CIFAR-10 not found in "
    )
    assert (
        "dataset=synthetic" in errors[0]
        and "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in errors[0]
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
