"""mk: a megakernel serving engine for North Mini Code."""

from mk.config import ModelConfig
from mk.engine.sampling import ConstraintSpec, SamplingParams

__all__ = ["LLM", "ConstraintSpec", "ModelConfig", "SamplingParams"]


def __getattr__(name: str):
    # `import mk` stays light (no torch); mk.LLM loads the engine on first use.
    if name == "LLM":
        from mk.llm import LLM

        return LLM
    raise AttributeError(f"module 'mk' has no attribute {name!r}")
