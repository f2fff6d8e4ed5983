"""The outputs of a run: the shipped checkpoint (`write_shipped`, and `unshippable`, what the device
machine could not return), the megakernel's verdict, the loss plot and the summary table."""

from __future__ import annotations

import math
from pathlib import Path

from mk.config import ModelConfig
from mk.model import write_checkpoint
from mk.model.names import expected_shapes


def plot(path: Path, result: dict, heldout_loss: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    h = result["history"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(h["step"], h["train_loss"], label="train (dropout on)", lw=1)
    ax.plot(h["val_step"], h["val_loss"], "o-", ms=3, label="validation")
    ax.axhline(heldout_loss, color="k", ls="--", lw=0.8, label=f"held-out files, best weights: {heldout_loss:.3f}")
    ax.axvline(result["best_step"], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_yscale("log")
    ax.set_title("mk embedded model on the Python standard library")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print("\n== embedded model ==")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# Shards of the shipped checkpoint: the device machine returns at most 8 files of at most 16 MiB, 64 MiB
# in all (scripts/device-train.sh sends the weights and one tar of the rest).
SHIPPED_SHARD_BYTES = 15 * 2**20
SHIPPED_MAX_BYTES = 60 * 2**20


def unshippable(cfg: ModelConfig) -> str | None:
    """Why the device machine could not return `cfg`'s bf16 weights (a tensor over a shard, too many
    bytes), or None. The sharder never splits a tensor."""
    shapes = expected_shapes(cfg)
    name, shape = max(shapes.items(), key=lambda kv: math.prod(kv[1]))
    total = 2 * sum(math.prod(s) for s in shapes.values())
    largest = 2 * math.prod(shape)
    if largest > SHIPPED_SHARD_BYTES:
        return (
            f"{name} {tuple(shape)} is {largest / 2**20:.1f} MiB in bf16, over a {SHIPPED_SHARD_BYTES >> 20} MiB shard"
        )
    if total > SHIPPED_MAX_BYTES:
        return f"the weights are {total / 2**20:.1f} MiB in bf16, over the {SHIPPED_MAX_BYTES >> 20} MiB returned"
    return None


def megakernel_verdict(cfg: ModelConfig) -> str:
    """Whether the megakernel can serve `cfg` (mk.megakernel.support), where mk's compiled module is
    importable (not on the device machine, which trains from python/)."""
    try:
        from mk.megakernel.support import geometry_unsupported
    except ImportError:
        return "not checked (mk's compiled module is not importable here)"
    why = geometry_unsupported(cfg)
    return "the megakernel can serve it" if why is None else why


def write_shipped(out_dir: Path, cfg: ModelConfig, weights: dict, tok, shard_bytes: int = SHIPPED_SHARD_BYTES) -> int:
    """Writes the shipped checkpoint, one file if it fits `shard_bytes`, else shards; returns its weight bytes."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    one_file = total <= shard_bytes
    write_checkpoint(out_dir, cfg, weights, tokenizer=tok, single_file=one_file, max_shard_bytes=shard_bytes)
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))
