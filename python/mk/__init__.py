"""mk: a megakernel serving engine for North Mini Code."""

from mk.config import ModelConfig

__all__ = ["ModelConfig"]
