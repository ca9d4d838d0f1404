"""Data: the image datasets (images.py: synthetic; cifar.py: CIFAR-10/100 from the official
archives), the text corpus (wikitext.py), the two batch pipelines that feed the loop
(pipelines.py), and the files they read (files.py: downloads, checksums, the array cache).
`build_image_data(cfg)` picks the image dataset."""
from __future__ import annotations

from ..config import ConfigError, DatasetConfig
from .cifar import load_cifar
from .images import ImageData, channel_stats, synthetic_images
from .pipelines import DeviceBatches, LoaderBatches, Resumable, image_loaders

__all__ = [
    "ImageData",
    "DeviceBatches",
    "LoaderBatches",
    "Resumable",
    "build_image_data",
    "channel_stats",
    "image_loaders",
    "synthetic_images",
]


def build_image_data(cfg: DatasetConfig) -> ImageData:
    """The dataset `cfg` names, as uint8 tensors on the CPU (raises data.files.DataError if it
    cannot be read)."""
    if cfg.is_text:
        raise ConfigError(
            f"dataset={cfg.name}: a text corpus, not images; "
            "mixprec.data.wikitext.load_text_corpus serves it (language models: model=lstm, gru, "
            "rnn_tanh, rnn_relu)"
        )
    if cfg.name == "synthetic":
        return synthetic_images(cfg)
    return load_cifar(cfg.name, cfg.data_dir, cfg.download, cfg.urls)
