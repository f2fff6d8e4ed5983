"""The model `python -m mk.server` serves when given none.

For now: the tiny geometry with fixed random weights and the built-in tokenizer and chat template, so
the whole serving path runs anywhere in seconds (the text is noise). The embedded trained model
replaces this one function.
"""

from __future__ import annotations

import torch

from mk.config import ModelConfig
from mk.model import synthetic_weights
from mk.model.reference import Model
from mk.tokenizer import Tokenizer

NAME = "mk-tiny-random"


def load_default(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Model, Tokenizer]:
    cfg = ModelConfig.tiny()
    model = Model(cfg, synthetic_weights(cfg, seed=0, device=device, dtype=dtype, std=0.1))
    return model, Tokenizer.builtin(cfg.vocab_size)
