"""Load an HF-layout North Mini Code checkpoint (config.json, model-*.safetensors) into a dict of tensors
keyed by HF name.

The headers of all shards are checked first (names and shapes, no tensor data read), so a bad checkpoint
fails in seconds with one error that lists every problem. Then tensors are streamed one at a time: read from
the shard, cast, moved to the target device. Host memory holds at most one source tensor beyond the result
(nothing beyond it when the target is a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from mk.config import ModelConfig
from mk.model.names import expected_shapes, is_skipped

# How many names a message lists before it says "... and N more".
_LIST_LIMIT = 10

# safetensors dtype name -> bytes per element, for the float dtypes a checkpoint may store weights in.
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointError(ValueError):
    """A checkpoint mk cannot load; the message names every offending file or tensor."""


def find_shards(path: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint folder in load order.

    `model-*.safetensors` (sorted), else a single `model.safetensors`, else `worker-*.safetensors` (sorted).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory")
    for pattern in ("model-*.safetensors", "model.safetensors", "worker-*.safetensors"):
        shards = sorted(path.glob(pattern))
        if shards:
            return shards
    raise CheckpointError(
        f"checkpoint {path}: no weight shards (looked for model-*.safetensors, model.safetensors, worker-*.safetensors)"
    )


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    if len(names) > _LIST_LIMIT:
        shown += f", ... and {len(names) - _LIST_LIMIT} more"
    return shown


def check_tensors(
    config: ModelConfig,
    found: dict[str, tuple[tuple[int, ...], str]],
    duplicates: Sequence[str] = (),
) -> list[str]:
    """Problems with a set of tensors {name: (shape, where)} against the geometry; empty when loadable.

    Skipped names (names.is_skipped) are ignored. `where` is the shard name, used in messages.
    """
    want = expected_shapes(config)
    problems: list[str] = []
    if duplicates:
        problems.append(f"tensors stored more than once ({len(duplicates)}): {_names(duplicates)}")
    unknown = [n for n in found if n not in want and not is_skipped(n)]
    if unknown:
        problems.append(f"unknown tensors ({len(unknown)}): {_names(unknown)}")
    missing = [n for n in want if n not in found]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_names(missing)}")
    bad = [
        f"{n} (in {found[n][1]}): expected shape {list(shape)}, got {list(found[n][0])}"
        for n, shape in want.items()
        if n in found and tuple(found[n][0]) != shape
    ]
    if bad:
        more = f" (showing {_LIST_LIMIT})" if len(bad) > _LIST_LIMIT else ""
        problems.append(f"wrong shapes ({len(bad)}){more}:\n    " + "\n    ".join(bad[:_LIST_LIMIT]))
    return problems


def _scan(shards: list[Path]) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str], list[str], list[str]]:
    """Read every shard header: (name -> (shape, shard)), (name -> dtype), duplicates, unreadable shards."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    dtypes: dict[str, str] = {}
    duplicates: list[str] = []
    broken: list[str] = []
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in found:
                        duplicates.append(f"{name} ({found[name][1]} and {shard.name})")
                        continue
                    found[name] = (tuple(sl.get_shape()), shard.name)
                    dtypes[name] = sl.get_dtype()
        except (SafetensorError, OSError) as e:
            broken.append(f"{shard.name}: not a readable safetensors file ({e})")
    return found, dtypes, duplicates, broken


def load_weights(
    path: str | Path,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Every tensor of `names.expected_shapes(config)`, cast to `dtype` on `device`, in that order.

    Raises CheckpointError listing all problems: no shards, unreadable shards, tensors stored twice, unknown
    names, missing names, wrong shapes, non-float dtypes.
    """
    path = Path(path)
    shards = find_shards(path)
    found, dtypes, duplicates, broken = _scan(shards)
    problems = broken + check_tensors(config, found, duplicates)
    want = expected_shapes(config)
    not_float = [f"{n} ({dtypes[n]})" for n in want if n in dtypes and dtypes[n] not in _FLOAT_BYTES]
    if not_float:
        problems.append(f"tensors of a non-float dtype ({len(not_float)}): {_names(not_float)}")
    if problems:
        raise CheckpointError(f"checkpoint {path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))

    device = torch.device(device)
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        names = [n for n, (_, where) in found.items() if where == shard.name and n in want]
        nbytes = sum(math.prod(found[n][0]) * _FLOAT_BYTES[dtypes[n]] for n in names)
        with (
            safe_open(shard, framework="pt") as f,
            tqdm(total=nbytes, desc=shard.name, unit="B", unit_scale=True, disable=None if progress else True) as bar,
        ):
            for name in names:
                t = f.get_tensor(name)
                loaded[name] = t.to(device=device, dtype=dtype)
                bar.update(t.numel() * t.element_size())
                del t
    return {n: loaded[n] for n in want}


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`config.json` (ConfigError names a bad field) and the weights of a checkpoint folder."""
    config = ModelConfig.from_json(path)
    return config, load_weights(path, config, device=device, dtype=dtype, progress=progress)
