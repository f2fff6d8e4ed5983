"""Write an HF-layout checkpoint folder: what `mk.model.load` reads and what HF tools expect.

- `config.json`: ModelConfig.to_dict()
- `model-00001-of-0000N.safetensors`, ...: the tensors in the order given, split at max_shard_bytes
- `model.safetensors.index.json`: {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
  (or, with `single_file=True`, one `model.safetensors` and no index, as small HF checkpoints ship)
- `tokenizer.json`, `tokenizer_config.json` (chat_template, bos_token, eos_token, ...)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from mk.config import ModelConfig
from mk.model.loader import CheckpointError, check_tensors
from mk.text import tokenizer_files

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_INDEX = "model.safetensors.index.json"


def _plan_shards(weights: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses views that share memory)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def write_checkpoint(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    chat_template: str = tokenizer_files.CHAT_TEMPLATE,
    check: bool = True,
    single_file: bool = False,
) -> Path:
    """Write `weights` (exactly these tensors, in their own dtype) as a checkpoint folder at `path`.

    `tokenizer=None` writes the built-in test tokenizer for `config.vocab_size` (mk.text.tokenizer_files); a given
    tokenizer must use that module's special tokens. `check=True` refuses weights that `load_weights` would
    reject; tests pass `check=False` to write malformed checkpoints on purpose. Tensors may live on any
    device: one shard at a time is copied to host memory. Shards of an earlier write into the same folder
    are removed first. `single_file=True` writes every tensor into one `model.safetensors` (no index).
    """
    path = Path(path)
    if check:
        found = {n: (tuple(t.shape), "weights") for n, t in weights.items()}
        problems = check_tensors(config, found)
        if problems:
            raise CheckpointError("refusing to write a checkpoint mk cannot load:\n  " + "\n  ".join(problems))
    if tokenizer is None:
        tokenizer = tokenizer_files.build_tokenizer(config.vocab_size)
    eos = tokenizer.token_to_id(tokenizer_files.EOS)
    if eos != config.eos_token_id:
        raise ValueError(
            f"tokenizer has {tokenizer_files.EOS} at id {eos}, config eos_token_id is {config.eos_token_id}"
        )
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, config vocab_size is {config.vocab_size}")

    path.mkdir(parents=True, exist_ok=True)
    # Left by an earlier write with another shard count or layout (the loader prefers model-*.safetensors).
    for stale in [*path.glob("model-*-of-*.safetensors"), path / "model.safetensors", path / _INDEX]:
        stale.unlink(missing_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")

    if single_file:
        save_file({n: _host_copy(t) for n, t in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})
        _write_tokenizer(path, tokenizer, chat_template)
        return path

    plan = _plan_shards(weights, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(plan):
        shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {n: _host_copy(weights[n]) for n in names}
        save_file(tensors, path / shard, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, shard))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _write_tokenizer(path, tokenizer, chat_template)
    return path


def _write_tokenizer(path: Path, tokenizer: Tokenizer, chat_template: str) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = tokenizer_files.tokenizer_config(chat_template)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
