"""The model `python -m mk.server` and `mk.LLM()` serve when given none.

The embedded model: the checkpoint folder `python/mk/embedded/` shipped inside the package (config.json,
safetensors shards and their index, tokenizer.json, tokenizer_config.json; trained by
scripts/train_embedded.py), loaded by the same loader as real checkpoints. When that folder is absent (a
source tree before its training run), the fallback is the tiny geometry with fixed random weights and the
built-in tokenizer: the whole serving path still runs, but the text is noise, and a warning says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mk.config import ModelConfig
from mk.model import load, synthetic_weights
from mk.model.reference import Model
from mk.text.tokenizer import Tokenizer

log = logging.getLogger("mk")

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_NAME = "mk-embedded"
FALLBACK_NAME = "mk-tiny-random"


def has_embedded(path: str | Path = EMBEDDED_DIR) -> bool:
    """True when `path` holds a checkpoint: a config.json and a tokenizer.json beside its weights."""
    path = Path(path)
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


# The served model name: fixed for an installation (the folder ships with the package or does not).
NAME = EMBEDDED_NAME if has_embedded() else FALLBACK_NAME


def load_default(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    path: str | Path | None = None,
) -> tuple[Model, Tokenizer]:
    """The embedded model and its tokenizer (from `path`, by default the package's embedded folder), or the
    tiny random-weight model with the built-in tokenizer when there is no checkpoint there."""
    path = EMBEDDED_DIR if path is None else Path(path)
    if has_embedded(path):
        return load(path, device=device, dtype=dtype, progress=False), Tokenizer.from_dir(path)
    log.warning(
        "no embedded model at %s (train it with scripts/train_embedded.py): serving the tiny model with "
        "random weights, whose output is noise",
        path,
    )
    cfg = ModelConfig.tiny()
    model = Model(cfg, synthetic_weights(cfg, seed=0, device=device, dtype=dtype, std=0.1))
    return model, Tokenizer.builtin(cfg.vocab_size)
