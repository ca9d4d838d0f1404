"""The image batch pipelines: crops, flips, cutout, resize, per-epoch permutation, seeding,
normalisation; the device-resident path and the DataLoader path serve the same batches."""
import numpy as np
import pytest
import torch

from mixprec.data import DeviceBatches, LoaderBatches, channel_stats

CPU = torch.device("cpu")
# normalisation that changes nothing
IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))


@pytest.fixture(autouse=True)
def one_thread():
    """Per-sample transforms run single-threaded, as in DataLoader workers (tiny ops; threads only
    cost here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PIPELINES = {"device": lambda *a, **k: DeviceBatches(*a, **k),
             "dataloader": lambda *a, **k: LoaderBatches(*a, workers=0, **k)}


def position_images(n: int, side: int = 8) -> torch.Tensor:
    """Every pixel of an image has its own value (y * side + x, plus a channel offset): a crop tells
    its offset."""
    plane = torch.arange(side * side).view(side, side)
    return (
        (plane + 64 * torch.arange(3).view(3, 1, 1))
        .expand(n, 3, side, side)
        .to(torch.uint8)
        .clone()
    )


def batches(pipeline, images, labels, batch_size, epochs=1, **kw):
    loader = PIPELINES[pipeline](images, labels, batch_size, **{**IDENTITY, **kw}, device=CPU)
    return [list(loader) for _ in range(epochs)]


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_crops_stay_inside_the_padded_image_and_cover_every_offset(pipeline):
    pad, n = 2, 48
    images = position_images(n)
    # numpy's own reflect
    padded = np.pad(images[0].numpy(), ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
    offsets = {
        (oy, ox): padded[:, oy : oy + 8, ox : ox + 8]
        for oy in range(2 * pad + 1)
        for ox in range(2 * pad + 1)
    }
    seen = []
    for epoch in batches(
        pipeline, images, torch.arange(n), 16, epochs=6, train=True, crop_padding=pad, seed=1
    ):
        for x, _ in epoch:
            for crop in x.numpy():
                match = [o for o, ref in offsets.items() if np.array_equal(crop, ref)]
                assert len(match) == 1, "a crop that is no window of the reflect-padded image"
                seen.append(match[0])
    assert set(seen) == set(offsets)                     # all 25 offsets over 288 draws
    assert max(seen.count(o) for o in offsets) < 40      # and none dominates (uniform: ~11.5 each)


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_flips_are_exact_mirror_images(pipeline):
    n = 64
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    flipped = 0
    for x, y in batches(pipeline, images, torch.arange(n), 16, train=True, flip=True, seed=2)[0]:
        for img, i in zip(x, y):
            original = images[i].float()
            assert torch.equal(img, original) or torch.equal(img, original.flip(-1))
            flipped += not torch.equal(img, original)
    assert 16 < flipped < 48          # about half of 64


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_every_sample_once_per_epoch_in_a_new_order(pipeline):
    n = 96
    images = torch.zeros(n, 3, 8, 8, dtype=torch.uint8)
    orders = [torch.cat([y for _, y in epoch]) for epoch in
              batches(pipeline, images, torch.arange(n), 32, epochs=3, train=True, seed=3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    # 100 samples in batches of 32: 3 full batches, the rest dropped, no sample twice
    dropped = batches(
        pipeline, torch.zeros(100, 3, 8, 8, dtype=torch.uint8), torch.arange(100), 32, train=True
    )[0]
    got = torch.cat([y for _, y in dropped]).tolist()
    assert len(dropped) == 3 and len(got) == len(set(got)) == 96
    # evaluation: every sample, in order, the last batch short
    test = batches(
        pipeline, torch.zeros(100, 3, 8, 8, dtype=torch.uint8), torch.arange(100), 32, train=False
    )[0]
    assert torch.cat([y for _, y in test]).tolist() == list(range(100)) and len(test[-1][1]) == 4


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_the_same_seed_gives_the_same_batches(pipeline):
    images = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    aug = dict(train=True, crop_padding=2, flip=True, cutout=3)

    def run(seed):
        if pipeline == "dataloader":
            # the global RNG is not what the draws come from (workers=0: a seeded generator)
            torch.manual_seed(0)
        return batches(pipeline, images, torch.arange(40), 8, epochs=2, seed=seed, **aug)

    a, b, c = run(5), run(5), run(6)
    flat = lambda runs: [t for epoch in runs for batch in epoch for t in batch]  # noqa: E731
    assert all(torch.equal(u, v) for u, v in zip(flat(a), flat(b)))
    assert not all(torch.equal(u, v) for u, v in zip(flat(a), flat(c)))


def test_channel_stats_and_normalised_batches_on_known_data():
    images = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    images[:, 0] = 255                              # red: all 255
    images[:2, 1] = 255                             # green: half 0, half 255
    # blue: 0, .2, .4, .6 in each image
    images[:, 2] = torch.tensor([[0, 51], [102, 153]], dtype=torch.uint8)
    mean, std = channel_stats(images)
    assert mean == pytest.approx((1.0, 0.5, 0.3)) and std[0] == 0.0
    assert std[1] == pytest.approx((16 * 0.25 / 15) ** 0.5) and std[2] == pytest.approx(
        (4 * 0.2 / 15) ** 0.5
    )
    # batches normalised with the training set's own stats have mean 0 and std 1 per channel
    images = torch.randint(0, 256, (200, 3, 8, 8), dtype=torch.uint8)
    images[:, 1] //= 4
    mean, std = channel_stats(images)
    for pipeline in PIPELINES:
        x = torch.cat(
            [
                x
                for x, _ in PIPELINES[pipeline](
                    images, torch.zeros(200), 64, mean, std, device=CPU, train=False
                )
            ]
        ).double()
        assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-5
        assert (x.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-5


def test_cutout_zeroes_one_square_inside_the_image():
    n, side = 64, 3
    images = torch.full((n, 3, 8, 8), 200, dtype=torch.uint8)
    (epoch,) = batches("device", images, torch.arange(n), 64, train=True, cutout=side, seed=4)
    corners = set()
    for img in epoch[0][0]:
        zero = (img == 0).all(0)
        assert int((img == 0).sum()) == 3 * side * side and (img[:, ~zero] == 200).all()
        ys, xs = zero.nonzero(as_tuple=True)
        # one whole square
        assert ys.max() - ys.min() == side - 1 and xs.max() - xs.min() == side - 1
        corners.add((int(ys.min()), int(xs.min())))
    assert len(corners) > 15 and all(0 <= c <= 8 - side for yx in corners for c in yx)


@pytest.mark.parametrize("pipeline", ["device", "dataloader"])
def test_image_size_resizes_and_channels_last(pipeline):
    images = torch.full((6, 3, 32, 32), 100, dtype=torch.uint8)
    images[:, :, :16] = 0  # top half black
    (batch,) = batches(
        pipeline, images, torch.arange(6), 6, train=False, size=16, channels_last=True
    )[0]
    x = batch[0]
    assert x.shape == (6, 3, 16, 16) and x.is_contiguous(memory_format=torch.channels_last)
    # rows away from the edge keep their value
    assert (x[:, :, :7] == 0).all() and (x[:, :, 9:] == 100).all()
    loader = PIPELINES[pipeline](
        images, torch.arange(6), 6, **IDENTITY, device=CPU, train=False, size=16
    )
    assert loader.image_shape == (3, 16, 16) and len(loader) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shard", [(0, 1), (1, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("cutout", [0, 3])
def test_the_one_gather_batches_are_the_prepared_ones_bit_for_bit(
    shard, channels_last, cutout, device
):
    """The device pipeline's training batches (crop, flip and selection in one gather:
    DeviceBatches.gathered) against the same loader through `prepare` (pad, crop, flip a float
    copy), the code it replaced: the same draws, the same values, the same layout, over two epochs;
    and fewer ops per batch."""
    images = torch.randint(
        0, 256, (40, 3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    kw = dict(
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.25, 0.3),
        device=torch.device(device),
        train=True,
        crop_padding=3,
        flip=True,
        cutout=cutout,
        seed=5,
        channels_last=channels_last,
        shard=shard,
    )
    fast, before = (
        DeviceBatches(images, torch.arange(40), 8, **kw),
        DeviceBatches(images, torch.arange(40), 8, **kw),
    )
    assert fast.gather is not None
    before.gather = None   # DeviceBatches.transform: prepare()
    for _ in range(2):
        for (x, y), (x0, y0) in zip(fast, before, strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0) and x.stride() == x0.stride()
    from helpers import load_script
    counter = load_script("bench_ladder_ops").OpCounter
    ops = []
    for loader in (fast, before):
        with counter() as c:
            next(iter(loader))
        ops.append(sum(c.parts.values()))
    # a batch with an epoch start (randperm): 24-38 ops, against 32-54
    assert ops[0] <= ops[1] - 8, ops


@pytest.mark.parametrize("cutout", [0, 3])
def test_the_loader_pads_and_normalises_once_and_serves_the_prepared_samples_bit_for_bit(cutout):
    """The dataloader pipeline (Page's step 1) pads and normalises the split once, then crops, flips
    and cuts out each sample: against `prepare` on each image (the code it replaced), the same draws
    give the same samples."""
    from mixprec.data.pipelines import _PaddedSamples, _PreparedSamples, norm_tensors

    images = torch.randint(
        0, 256, (30, 3, 9, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    norm = norm_tensors((0.4, 0.5, 0.6), (0.2, 0.25, 0.3), CPU)
    kw = dict(pad=3, flip=True, cutout=cutout)
    fast = _PaddedSamples(
        images, torch.arange(30), *norm, generator=torch.Generator().manual_seed(7), **kw
    )
    before = _PreparedSamples(
        images, torch.arange(30), *norm, generator=torch.Generator().manual_seed(7), **kw
    )
    for _ in range(3):
        for i in range(30):
            (x, y), (x0, y0) = fast[i], before[i]
            assert torch.equal(x, x0) and y == y0, i
    loader = LoaderBatches(
        images,
        torch.arange(30),
        8,
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.25, 0.3),
        device=CPU,
        train=True,
        crop_padding=3,
        flip=True,
        cutout=cutout,
        workers=0,
    )
    assert isinstance(loader.loader.dataset, _PaddedSamples) and len(list(loader)) == 3


def test_the_two_pipelines_serve_the_same_evaluation_batches_and_workers_run():
    images = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8)
    kw = dict(mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), device=CPU, train=False)
    device = list(DeviceBatches(images, torch.arange(50), 16, **kw))
    loader = list(LoaderBatches(images, torch.arange(50), 16, workers=2, **kw))
    assert len(device) == len(loader) == 4
    for (a, ya), (b, yb) in zip(device, loader):
        assert torch.equal(ya, yb) and torch.allclose(a, b, atol=1e-6)
    train = LoaderBatches(
        images, torch.arange(50), 16, workers=2, crop_padding=2, flip=True, **{**kw, "train": True}
    )
    for _ in range(2):
        got = torch.cat([y for _, y in train]).tolist()
        assert len(got) == len(set(got)) == 48


LOADER_LEFT_OPEN = """
import signal, torch
from mixprec.data import LoaderBatches
images = torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8)
LEFT = LoaderBatches(images, torch.arange(32), 8, (0.5,) * 3, (0.25,) * 3,
                     device=torch.device("cpu"), train=True, workers=2)
assert len(list(LEFT)) == 4
worker = LEFT.loader._iterator._workers[0]
# the main process keeps its own handlers
assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
print(worker.pid, flush=True)
"""


@pytest.mark.slow
def test_loader_workers_ignore_stop_signals_and_end_with_the_process(tmp_path):
    """Workers ignore SIGTERM/SIGINT (a signal to the process group is the job's to handle:
    test_resume.py), so multiprocessing's exit hook, which terminates and joins them, would wait
    forever for a loader left open at exit: pipelines.py stops every open loader's workers first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3] / "src"))
    r = subprocess.run(
        [sys.executable, "-c", LOADER_LEFT_OPEN],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    pid = int(r.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)   # the worker is gone too
