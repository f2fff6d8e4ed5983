"""`python -m mk`: the model-only smoke run (reference model, paged KV, greedy)."""

import subprocess
import sys

import pytest
import torch

from mk.config import ModelConfig
from mk.model import synthetic_weights, write_checkpoint
from mk.model.reference import Model

pytestmark = pytest.mark.slow  # (runs python -m mk.server and the package's commands as processes)


def run_mk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mk", "--device", "cpu", *args], capture_output=True, text=True, timeout=120
    )


def test_generates_the_requested_number_of_tokens():
    out = run_mk("--max-tokens", "5", "--prompt", "import os")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os")
    assert "generated tokens on cpu" in out.stdout


def test_checkpoint_generation_matches_one_shot_greedy(tmp_path):
    """The paged decode loop of `python -m mk` gives the tokens a one-shot prefill picks."""
    cfg = ModelConfig.tiny()
    weights = synthetic_weights(cfg, seed=7, dtype=torch.float32, std=0.1)
    write_checkpoint(tmp_path, cfg, weights)
    out = run_mk("--model", str(tmp_path), "--max-tokens", "4", "--prompt", "x = 1")
    assert out.returncode == 0, out.stderr

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("x = 1").ids
    model = Model(cfg, weights)
    for _ in range(4):
        ids.append(int(model.logits(ids)[-1].argmax()))
    assert out.stdout.splitlines()[0] == "x = 1" + tok.decode(ids[len(tok.encode("x = 1").ids) :]).splitlines()[0]


def test_bad_flag_is_refused_with_a_reason():
    out = run_mk("--max-tokens", "0")
    assert out.returncode != 0
    assert "--max-tokens must be at least 1" in out.stderr
