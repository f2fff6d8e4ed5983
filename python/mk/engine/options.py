"""`EngineOptions`: every option of the engine, stated once.

Each field is an option: its name, type, default and meaning. `mk.engine.engine.Engine` takes them,
`python -m mk.server` generates its flags from them (`add_arguments`, `from_arguments`), and the
Rust decode loop reads the resolved ones by name (`mk._native.Engine`). `None` in a field that
allows it, or "auto", lets the engine decide by the machine, the model and the other options:
`resolved` decides every such option in one place, and `Engine.options` holds the outcome.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from mk import _native
from mk.engine import memory
from mk.megakernel.support import BACKENDS

# Sequences decoded together on a GPU: the rows of one megakernel launch (its wide image), which
# decodes them faster than two launches of 8, and a 9th concurrent request starts at once instead
# of waiting for a running one to finish.
GPU_MAX_BATCH = _native.STEP_MAX_ROWS
# On the CPU, whose KV pool is sized for a whole batch: a smaller batch.
CPU_MAX_BATCH = 8
# Prompt tokens one loop iteration prefills on a GPU. A prefill call that does not replay a CUDA
# graph pays a fixed host cost of launches, so fewer, larger chunks win; a decoding stream then
# waits up to one chunk's time while a long prompt is admitted, unless the sliced prefill cuts it.
PREFILL_CHUNK = 8192
# On the CPU, where a chunk takes far longer and a decoding stream waits for it: smaller.
CPU_PREFILL_CHUNK = 512
# Prompt tokens through the whole model (tokens x layers / layers) one loop iteration prefills
# while some stream decodes, with the sliced prefill: it bounds a stream's pause while a long
# prompt is admitted, and each slice between decode steps delays that prompt's first token
# (docs/PERF.md, tuning decisions).
DECODE_PREFILL_BUDGET = 512
# With the sliced prefill and both kinds of prefill graph: a prefill call of one chunk of up to this
# many tokens (a next turn, a short prompt, a long prompt's last chunk) runs whole, one graph
# replay, instead of slices of the eager path (docs/PERF.md, tuning decisions).
WHOLE_CHUNK_TOKENS = 1024
# The share of the card's memory mk may use by default (vLLM's `--gpu-memory-utilization` means
# the same): the rest is left to the driver, other processes and the allocator's fragmentation.
GPU_MEMORY_UTILIZATION = 0.9
# Most tokens per sequence: the engine's default, and the server's when --max-context is not given
# (for a model directory whose tokenizer states no model_max_length, and for the built-in model;
# --synthetic stands for the real model, hence its longer one).
ENGINE_MAX_CONTEXT = 4096
SERVER_MAX_CONTEXT = 8192
SYNTHETIC_MAX_CONTEXT = 32768
DEALINGS = ("round_robin", "balanced")
PREFILLS = ("auto", "packed", "plain")
# An auto/on/off switch's words and the field's value (None: the engine decides).
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def _option(default: Any, help: str, *, flag: bool = True, minimum: float | None = None, **more: Any):
    """A field of EngineOptions: `help` says what it does (the server's --help and the docs);
    `flag`: whether the server has a flag for it; `minimum`: the least value allowed; `switch`: an
    auto/on/off option (None, True, False); `choices`:
    the values allowed; `default_text`: the default in words where the value alone does not say it;
    `server_default`: the flag's default where the server decides it (None: not given)."""
    return field(default=default, metadata={"help": help, "flag": flag, "minimum": minimum, **more})


def _switch(help: str, auto: str):
    """An auto/on/off field: None (auto) lets the engine decide as `auto` says."""
    return _option(None, help, switch=True, default_text=f"auto = {auto}")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The engine's options (module docstring). Invalid values are a ValueError here."""

    backend: str = _option(
        "auto",
        "what decodes: megakernel = the decode megakernel (bf16 on a Hopper GPU), pytorch = the PyTorch model's "
        "forward (mk.model), auto = the megakernel wherever it can run",
        choices=BACKENDS,
    )
    prefill: str = _option(
        "auto",
        "what prefills prompts: packed = the packed prefill (mk.prefill: flex attention, grouped-GEMM experts, "
        "packed prompts; compiles at start), plain = the model's plain forward, auto = packed on a GPU and plain on "
        "the CPU",
        choices=PREFILLS,
    )
    max_batch: int | None = _option(
        None,
        f"most sequences decoded together; up to {GPU_MAX_BATCH} run as one megakernel launch, more as several",
        minimum=1,
        default_text=f"{GPU_MAX_BATCH} on a GPU, {CPU_MAX_BATCH} on the CPU",
    )
    max_context: int = _option(
        ENGINE_MAX_CONTEXT,
        "most tokens per sequence, prompt plus completion; on a GPU, a context whose sequence the KV cache cannot "
        "hold is an error at start naming the longest that fits (with fit_context: that one is taken instead)",
        minimum=2,
        server_default=None,
        default_text=f"the engine's {ENGINE_MAX_CONTEXT}; the server's: the tokenizer's model_max_length (else "
        f"{SERVER_MAX_CONTEXT}), {SERVER_MAX_CONTEXT} for the built-in model, {SYNTHETIC_MAX_CONTEXT} with "
        "--synthetic, on a GPU at most what the KV cache holds",
    )
    max_waiting: int = _option(256, "requests queued beyond the batch before new ones are refused (503)", minimum=1)
    gpu_memory_utilization: float = _option(
        GPU_MEMORY_UTILIZATION,
        "share of the GPU's total memory mk may use, everything included (weights, KV cache, prefill activations, "
        "CUDA graphs): the KV cache gets what the rest leaves, measured by a warm-up at start; in (0, 1]",
    )
    prefill_chunk: int | None = _option(
        None,
        "most prompt tokens prefilled per loop iteration: larger gives long prompts a sooner first token, smaller "
        "makes running streams wait less while a long prompt is admitted",
        minimum=16,
        default_text=f"{PREFILL_CHUNK} on a GPU, {CPU_PREFILL_CHUNK} on the CPU",
    )
    decode_prefill_budget: int | None = _option(
        None,
        "most prompt tokens one loop iteration prefills while streams decode (with sliced prefill: tokens through "
        "the whole model): smaller shortens the streams' longest pause while a long prompt is admitted",
        minimum=1,
        default_text=f"{DECODE_PREFILL_BUDGET} with sliced prefill, else the prefill chunk",
    )
    sliced_prefill: bool | None = _switch(
        "while streams decode, run each prompt chunk over several loop iterations, a few layers each, within the "
        "decode prefill budget of tokens through the whole model, a decode step between them: the streams pause "
        "as little as with small chunks while the prompt keeps whole chunks; on needs the packed prefill",
        "on wherever the packed prefill runs on a GPU",
    )
    whole_chunk_tokens: int | None = _option(
        None,
        "with sliced prefill: a prompt chunk of one request of up to this many tokens runs at once, not in slices "
        "(it replays a CUDA graph, which pauses the streams once and less than the eager slices would); 0 = slice "
        "every chunk past the budget",
        minimum=0,
        default_text=f"{WHOLE_CHUNK_TOKENS} with both kinds of prefill graph, else 0",
    )
    prefill_graphs: bool | None = _switch(
        "prefill a fresh prompt (no cached prefix) of up to one chunk as a CUDA graph replay, captured per padded "
        "length at start: a short prompt's first token without the eager path's fixed host time, for GPU memory "
        "the start's memory plan counts",
        "on with the packed prefill on a GPU where its MoE is the grouped one (bf16)",
    )
    prefix_graphs: bool | None = _switch(
        "prefill a chunk after a cached prefix (a conversation's next turn) as a CUDA graph replay too, captured "
        "per padded (tokens, keys) shape at start, so that a next turn's first token comes without the eager "
        "path's launches; on = every chunk length (more captures and memory)",
        "the shortest chunks (mk.prefill.prefixed.NEXT_TURN_BUCKETS) with the packed prefill on a GPU where its MoE is "
        "the grouped one (bf16)",
    )
    launch_ahead: bool | None = _switch(
        "launch each decode step before the previous step's tokens reach the host, so the GPU runs steps back to "
        "back (rows the kernel draws itself: greedy, or a temperature without top_k, top_p, logprobs or a grammar; "
        "others run one step at a time)",
        "on with the megakernel backend",
    )
    kernel_masks: bool | None = _switch(
        "draw grammar-constrained rows (greedy, or a temperature alone) on the GPU among their mask's tokens "
        "instead of copying their logits back and drawing on the host; on needs the megakernel backend",
        "on with the megakernel backend",
    )
    late_masks: bool | None = _switch(
        "launch steps with grammar-constrained rows ahead too, their masks computed while the step runs and the "
        "kernel waiting for them only where it samples; on needs kernel masks and launch-ahead",
        "on wherever kernel masks and launch-ahead are",
    )
    speculative: bool | None = _switch(
        "speculative decoding: verify tokens copied from a request's own text (its prompt and output so far: code "
        "it repeats or edits), or another running request's, in the same decode step as its next token, so that "
        "a step may give it several tokens; the output is token for token what decoding without drafts gives (a "
        "sampled request's seed for seed); under a grammar only tokens it takes are drafted; /metrics counts the "
        "draft tokens and those accepted",
        "on with the megakernel, off with the PyTorch backend",
    )
    # Options for scripts and tests, without a server flag.
    kv_blocks: int | None = _option(None, "the KV pool's blocks (None: the memory plan's)", flag=False, minimum=1)
    kv_bytes: int | None = _option(None, "the KV pool's bytes, if kv_blocks is not given", flag=False, minimum=1)
    fit_context: bool = _option(False, "take the longest context the KV pool holds, up to max_context", flag=False)
    fresh_split: bool = _option(
        True,
        "with both kinds of prefill graph, a fresh prompt just past a bucket of 4K tokens or more replays that "
        "bucket's graph and then a next-turn graph of the rest (mk.prefill.fresh.fresh_split)",
        flag=False,
    )
    dealing: str = _option(
        "round_robin",
        "how the megakernel's tasks are dealt to the SMs: round_robin, or balanced by the graph's cost model (an "
        "experiment until a GPU run compares them)",
        flag=False,
        choices=DEALINGS,
    )
    check_invariants: bool = _option(False, "check the KV pool's invariants after every step (tests)", flag=False)
    progress: bool = _option(True, "a progress bar for the start's warm-up where stderr is a terminal", flag=False)
    salt: bytes | None = _option(
        None, "the prefix cache's key salt (None: the model's geometry, dtype and weights)", flag=False
    )
    tokenizer_json: str | None = _option(
        None, "tokenizer.json's text: constrained requests compile their grammars against it", flag=False
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            if meta.get("switch") and type(value) is not bool:
                raise ValueError(f"{f.name} must be None (auto), True or False, not {value!r}")
            choices, minimum = meta.get("choices"), meta["minimum"]
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(repr, choices))}, not {value!r}")
            if minimum is not None and value < minimum:
                raise ValueError(f"{f.name} must be at least {minimum}, got {value}")
        memory.check_utilization(self.gpu_memory_utilization)
        if self.sliced_prefill and self.prefill == "plain":
            raise ValueError("sliced_prefill needs the packed prefill, and prefill is 'plain'")

    def resolved(self, *, cuda: bool, backend: str) -> EngineOptions:
        """The options with every automatic choice made, for a model on a GPU (`cuda`) or the CPU
        decoded by `backend` ("megakernel" or "pytorch": what `backend` "auto" came to). The
        prefill graphs and whole_chunk_tokens are decided by the warm-up (Engine); a combination
        that cannot run is a ValueError."""
        megakernel = backend == "megakernel"
        packed = self.prefill == "packed" or (self.prefill == "auto" and cuda)
        if self.kernel_masks and not megakernel:
            raise ValueError(f"kernel_masks needs the megakernel backend; this engine decodes with {backend!r}")
        if self.sliced_prefill and not packed:
            raise ValueError("sliced_prefill needs the packed prefill (prefill='packed')")
        kernel_masks = megakernel if self.kernel_masks is None else self.kernel_masks
        if self.late_masks and not kernel_masks:
            raise ValueError("late_masks needs kernel_masks (the megakernel backend's)")
        launch_ahead = megakernel if self.launch_ahead is None else self.launch_ahead
        if self.late_masks and not launch_ahead:
            raise ValueError("late_masks needs launch-ahead (launch_ahead=False turns it off)")
        chunk = self.prefill_chunk or (PREFILL_CHUNK if cuda else CPU_PREFILL_CHUNK)
        sliced = packed and cuda if self.sliced_prefill is None else self.sliced_prefill
        budget = self.decode_prefill_budget
        if budget is None:
            budget = min(DECODE_PREFILL_BUDGET, chunk) if sliced else chunk
        return dataclasses.replace(
            self,
            backend=backend,
            prefill="packed" if packed else "plain",
            max_batch=self.max_batch or (GPU_MAX_BATCH if cuda else CPU_MAX_BATCH),
            prefill_chunk=chunk,
            decode_prefill_budget=budget,
            sliced_prefill=sliced,
            launch_ahead=launch_ahead,
            kernel_masks=kernel_masks,
            late_masks=kernel_masks and launch_ahead if self.late_masks is None else self.late_masks,
            # auto: with the megakernel, whose verification rows share its launch's weight pass.
            speculative=megakernel if self.speculative is None else self.speculative,
        )

    @property
    def max_draft(self) -> int:
        """The most draft tokens a sequence verifies in a step (0: speculative decoding is off)."""
        return _native.MAX_DRAFT if self.speculative else 0


def flag_fields() -> list[dataclasses.Field]:
    """The options the server has a flag for, in --help's order."""
    return [f for f in dataclasses.fields(EngineOptions) if f.metadata["flag"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag for each option that has one: --max-batch for max_batch, and so on."""
    for f in flag_fields():
        meta, name = f.metadata, "--" + f.name.replace("_", "-")
        shown = meta.get("default_text") or f.default
        text = f"{meta['help']} (default: {shown})"
        if meta.get("switch"):
            parser.add_argument(name, choices=list(AUTO_ON_OFF), nargs="?", const="on", default="auto", help=text)
            continue
        default = meta.get("server_default", f.default)
        if meta.get("choices"):
            parser.add_argument(name, choices=list(meta["choices"]), default=default, help=text)
        else:
            kind = float if isinstance(f.default, float) else int
            parser.add_argument(name, type=_number(kind, f.name), default=default, help=text)


def from_arguments(args: argparse.Namespace, **more: Any) -> EngineOptions:
    """The options the flags of `add_arguments` gave, with `more` (options without a flag, or
    what the server decided for one it left open)."""
    given = {}
    for f in flag_fields():
        value = getattr(args, f.name)
        if value is None and f.default is not None:
            continue  # a flag whose default the server decides, not given (max_context)
        given[f.name] = AUTO_ON_OFF[value] if f.metadata.get("switch") else value
    return EngineOptions(**{**given, **more})


def in_flags_words(message: str) -> str:
    """An EngineOptions error with its options named as the server's flags (--max-batch)."""
    names = "|".join(f.name for f in flag_fields())
    return re.sub(rf"\b({names})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def _number(kind: type, name: str):
    """argparse's parser of an option's number, checked by EngineOptions' own rules."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            EngineOptions(**{name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name} ")) from None
        return value

    return parse
