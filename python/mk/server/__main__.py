"""`python -m mk.server`: the OpenAI-compatible server.

With no arguments it serves the built-in model (a small coder of North Mini Code's architecture,
trained on the Python sources of a site-packages corpus, 198 installed packages, and the standard
library (docs/EMBEDDED.md): it writes code-shaped text, not good code) on
127.0.0.1:8000, on the GPU when there is one. Routes: /v1/chat/completions, /v1/completions,
/v1/models[/ID], Anthropic's /v1/messages and /v1/messages/count_tokens, vLLM's /tokenize and
/detokenize, /health, /metrics (Prometheus; README "Metrics" lists them).

With --data-parallel-size N it starts N such servers (one per GPU) behind one public port that answers
as one server does (mk/server/replicas.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch

from mk.engine_api import (
    AUTO_ON_OFF,
    CPU_MAX_BATCH,
    CPU_PREFILL_CHUNK,
    DECODE_PREFILL_BUDGET,
    MAX_BATCH,
    PREFILL_CHUNK,
    WHOLE_CHUNK_TOKENS,
)
from mk.memory import GPU_MEMORY_UTILIZATION
from mk.prefill_graphs import NEXT_TURN_BUCKETS
from mk.server.app import App
from mk.server.http import BODY_TIMEOUT_S
from mk.server.serve import check_port, serve
from mk.server.state import ServerState

log = logging.getLogger("mk.server")

# A request in flight that has not finished this long after SIGTERM is cancelled.
DRAIN_TIMEOUT_S = 30.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _auto_on_off(p: argparse.ArgumentParser, flag: str, text: str) -> None:
    """A switch the engine decides by default (`auto`); the flag alone means `on`."""
    p.add_argument(flag, choices=list(AUTO_ON_OFF), nargs="?", const="on", default="auto", help=text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < 86400:
        raise argparse.ArgumentTypeError(f"must be between 0 and 86400, got {value}")
    return value


def _origins(text: str) -> frozenset[str]:
    """--allowed-origins: origins as browsers send them (scheme://host[:port], no path), or "*"."""
    origins = frozenset(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    bad = [o for o in origins if o != "*" and ("://" not in o or "/" in o.split("://", 1)[1])]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not an origin (scheme://host[:port]) or '*'")
    return origins


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # No abbreviations: a data-parallel parent passes its options on to its replicas verbatim.
    p = _Parser(
        prog="python -m mk.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_at_least(1), default=8000, help="TCP port (default: %(default)s)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        type=Path,
        help="checkpoint folder: config.json, *.safetensors, tokenizer.json, "
        "tokenizer_config.json (default: the built-in model)",
    )
    src.add_argument(
        "--synthetic",
        action="store_true",
        help="full-size North Mini Code geometry with random weights made on the GPU (for benchmarks)",
    )
    p.add_argument(
        "--served-model-name", help="model id clients send and /v1/models lists (default: the checkpoint folder's name)"
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the model runs: auto = the GPU when there is one (default: %(default)s)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "megakernel", "reference"],
        default="auto",
        help="what decodes: the megakernel (bf16 on a Hopper GPU), the PyTorch reference model, or auto = "
        "the megakernel wherever it can run (default: %(default)s)",
    )
    p.add_argument(
        "--prefill",
        choices=["auto", "fast", "reference"],
        default="auto",
        help="what prefills prompts: fast = mk.prefill (flex attention, grouped-GEMM experts, packed prompts; "
        "compiles at start), reference = the reference model's forward, auto = fast on a GPU and reference on "
        "the CPU (default: %(default)s)",
    )
    _auto_on_off(
        p,
        "--launch-ahead",
        "launch each decode step before the previous step's tokens reach the host, so the GPU runs steps "
        "back to back (rows the kernel draws itself: greedy, or a temperature without top_k, top_p, logprobs "
        "or a grammar; others run one step at a time); auto = on with the megakernel backend, off with the "
        "reference one (default: %(default)s)",
    )
    _auto_on_off(
        p,
        "--prefill-graphs",
        "prefill a fresh prompt (no cached prefix) of up to one chunk as a CUDA graph replay, captured per "
        "padded length at start: a short prompt's first token without the fixed host time of the eager path's "
        "launches, for GPU memory the start's memory plan counts; auto = on with the fast prefill on a GPU "
        "(default: %(default)s)",
    )
    _auto_on_off(
        p,
        "--prefix-graphs",
        "prefill a chunk after a cached prefix (a conversation's next turn, its history from the prefix cache) as "
        "a CUDA graph replay too, captured per padded (tokens, keys) shape at start, so that a next turn's first "
        f"token comes without the eager path's launches; auto = chunks of up to {NEXT_TURN_BUCKETS[-1]} tokens "
        "with the fast prefill on a GPU, on = every chunk length (more captures and memory) (default: %(default)s)",
    )
    p.add_argument(
        "--decode-prefill-budget",
        type=_at_least(1),
        help="most prompt tokens one loop iteration prefills while streams decode (with --sliced-prefill: tokens "
        "through the whole model): smaller shortens the streams' longest pause while a long prompt is admitted "
        f"(default: {DECODE_PREFILL_BUDGET} with --sliced-prefill, else --prefill-chunk)",
    )
    _auto_on_off(
        p,
        "--sliced-prefill",
        "while streams decode, run each prompt chunk over several loop iterations, a few layers each, within "
        "--decode-prefill-budget tokens through the whole model, a decode step between them: the streams pause as "
        "little as with small chunks while the prompt keeps whole chunks, its first token only the decode steps "
        "in between later; auto = on wherever the fast prefill runs on a GPU; on needs the fast prefill (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--whole-chunk-tokens",
        type=_at_least(0),
        help="with --sliced-prefill: a prompt chunk of one request of up to this many tokens runs at once, not in "
        "slices (it replays a CUDA graph, which pauses the streams once and less than the eager slices would); 0 = "
        f"slice every chunk past the budget (default: {WHOLE_CHUNK_TOKENS} with both kinds of prefill graph, else 0)",
    )
    _auto_on_off(
        p,
        "--kernel-masks",
        "draw grammar-constrained rows (greedy, or a temperature alone) on the GPU among their mask's tokens "
        "instead of copying their logits back and drawing on the host; auto = on with the megakernel backend, off "
        "with the reference one; on with the reference backend is an error (default: %(default)s)",
    )
    _auto_on_off(
        p,
        "--late-masks",
        "launch steps with grammar-constrained rows ahead too, their masks computed while the step runs and "
        "the kernel waiting for them only where it samples; auto = on wherever --kernel-masks and --launch-ahead "
        "are; on needs both (default: %(default)s)",
    )
    _auto_on_off(
        p,
        "--speculative",
        "speculative decoding: verify tokens copied from a request's own text (its prompt and output so far: code "
        "it repeats or edits) in the same decode step as its next token, so that a step may give it several "
        "tokens; the output is token for token what decoding without drafts gives (a sampled request's seed for "
        "seed); under a grammar only tokens it takes are drafted; /metrics counts the draft tokens and "
        "those accepted; auto = off for now (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=_at_least(1),
        default=None,
        help=f"most sequences decoded together; up to {MAX_BATCH} run as one megakernel launch, more as several "
        f"(default: {MAX_BATCH} on a GPU, {CPU_MAX_BATCH} on the CPU)",
    )
    p.add_argument(
        "--max-context",
        type=_at_least(2),
        help="most tokens per sequence, prompt plus completion; on a GPU, a context whose sequence the KV cache "
        "cannot hold is an error at start naming the longest that fits (default: the tokenizer's "
        "model_max_length, 8192 for the built-in model, 32768 with --synthetic; on a GPU at most what the KV "
        "cache holds)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=GPU_MEMORY_UTILIZATION,
        help="share of the GPU's total memory mk may use, everything included (weights, KV cache, prefill "
        "activations, CUDA graphs): the KV cache gets what the rest leaves, measured by a warm-up at start "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=_at_least(16),
        default=None,
        help="most prompt tokens prefilled per engine iteration: larger gives long prompts a sooner first token, "
        f"smaller makes running streams wait less while a long prompt is admitted (default: {PREFILL_CHUNK} on a "
        f"GPU, {CPU_PREFILL_CHUNK} on the CPU)",
    )
    p.add_argument(
        "--token-healing",
        choices=["on", "off"],
        default="on",
        help="on /v1/completions, back a text prompt that ends where a longer token could start (a bare newline, "
        "say) up by its last token or two and hold the completion to begin with their text, which the returned "
        "text leaves out; the same for a prefilled chat answer (a Messages request's last assistant message, "
        "chat's continue_final_message); not for requests with a grammar of their own or ignore_eos, nor "
        "token-id prompts; a completion request's token_healing field overrides it (default: %(default)s)",
    )
    p.add_argument(
        "--max-waiting",
        type=_at_least(1),
        default=256,
        help="requests queued beyond the batch before new ones get 503 (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MK_API_KEY"),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health and /metrics "
        "(default: $MK_API_KEY; none)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_origins,
        default=frozenset(),
        help="comma-separated browser origins allowed to call the API (CORS), such as "
        "'https://app.example.com', or '*' for any (default: none; no CORS headers)",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="make /metrics require the API key too (by default it is open to scrapers, as in vLLM)",
    )
    p.add_argument(
        "--max-body-mb",
        type=_at_least(1),
        default=32,
        help="largest request body accepted, in MiB; larger gets 413 (default: %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=_seconds,
        default=BODY_TIMEOUT_S,
        help="seconds a request's body may stall, nothing of it arriving, before the request is answered "
        "408 and its connection freed (default: %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long running requests may take to finish (default: %(default)s s)",
    )
    p.add_argument(
        "--stats-interval",
        type=_seconds,
        default=5.0,
        help="seconds between engine status lines in the log (default: %(default)s)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=_at_least(1),
        default=1,
        help="engine replicas, one per GPU (or CPU replicas with --device cpu), behind one server on --host/"
        "--port with cache-aware routing; 1 = this one process (default: %(default)s)",
    )
    p.add_argument(
        "--replica-base-port",
        type=_at_least(1),
        help="with --data-parallel-size N: replica i listens on 127.0.0.1:BASE+i (default: --port + 1)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log verbosity (default: %(default)s)",
    )
    args = p.parse_args(argv)
    if args.api_key == "":
        p.error("--api-key must not be empty")
    if args.port > 65535:
        p.error(f"--port must be at most 65535, got {args.port}")
    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model}: no such folder")
    if args.stats_interval == 0:
        p.error("--stats-interval must be above 0")
    if args.body_timeout == 0:
        p.error("--body-timeout must be above 0")
    if args.replica_base_port is not None and args.data_parallel_size == 1:
        p.error("--replica-base-port is for --data-parallel-size 2 or more")
    if args.sliced_prefill == "on" and args.prefill == "reference":
        p.error("--sliced-prefill on needs the fast prefill (not --prefill reference)")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    replica = os.environ.get("MK_REPLICA")  # set by a data-parallel parent for its children
    prefix = f"replica {replica} " if replica is not None else ""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.data_parallel_size > 1:
        from mk.server.replicas import ReplicaError, serve_replicas

        try:
            sys.exit(serve_replicas(args, argv))
        except (ReplicaError, OSError) as e:
            sys.exit(f"python -m mk.server: error: {e}")
    try:
        check_port(args.host, args.port)  # before the model loads, and before any "serving" line
        state = build_state(args)
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"python -m mk.server: error: {e}")
    asyncio.run(serve(App(state), args.host, args.port, args.drain_timeout, args.log_level == "debug"))


def build_state(args: argparse.Namespace) -> ServerState:
    from mk.engine import Engine
    from mk.model import load
    from mk.tokenizer import Tokenizer

    cuda = torch.cuda.is_available()
    progress = os.environ.get("MK_REPLICA") is None  # (replicas share the parent's terminal: no bars)
    if args.device == "cuda" and not cuda:
        raise RuntimeError("--device cuda: no GPU is visible")
    if args.synthetic and not cuda:
        raise RuntimeError("--synthetic makes full-size weights on a GPU, and no GPU is visible")
    device = torch.device("cuda" if args.synthetic or (cuda and args.device != "cpu") else "cpu")
    if args.backend == "megakernel" and device.type != "cuda":
        # Said before any weights load; the engine names any other reason (not Hopper, say).
        raise RuntimeError("--backend megakernel runs on an NVIDIA Hopper GPU, and the model would be on the CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model is not None:
        log.info("loading %s on %s (%s)", args.model, device, dtype)
        model = load(args.model, device=device, dtype=dtype, progress=progress)
        tokenizer = Tokenizer.from_dir(args.model)
        name = args.served_model_name or args.model.resolve().name
        default_context = int(tokenizer.config.get("model_max_length") or 8192)
    elif args.synthetic:
        model, tokenizer = _synthetic(device)
        name, default_context = args.served_model_name or "north-mini-code-synthetic", 32768
    else:
        from mk.default_model import NAME, load_default

        model, tokenizer = load_default(device, dtype)
        name, default_context = args.served_model_name or NAME, 8192
    max_context = args.max_context or min(default_context, 1 << 20)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_context=max_context,
        max_waiting=args.max_waiting,
        gpu_memory_utilization=args.gpu_memory_utilization,
        fit_context=args.max_context is None,  # (a context asked for is an error where it cannot fit)
        prefill_chunk=args.prefill_chunk,
        backend=args.backend,
        prefill=args.prefill,
        tokenizer_json=tokenizer.hf.to_str(),  # constrained requests compile against its vocabulary
        launch_ahead=AUTO_ON_OFF[args.launch_ahead],
        prefill_graphs=AUTO_ON_OFF[args.prefill_graphs],
        prefix_graphs=AUTO_ON_OFF[args.prefix_graphs],
        decode_prefill_budget=args.decode_prefill_budget,
        sliced_prefill=AUTO_ON_OFF[args.sliced_prefill],
        whole_chunk_tokens=args.whole_chunk_tokens,
        kernel_masks=AUTO_ON_OFF[args.kernel_masks],
        late_masks=AUTO_ON_OFF[args.late_masks],
        speculative=args.speculative,
        progress=progress,
    )
    if args.token_healing == "on":
        from mk.healing import warm_up

        warm_up(tokenizer)
    graphs = (("of fresh prompts", engine.prefill_graphs), ("after a cached prefix", engine.prefix_graphs))
    log.info(
        "engine ready: %s, %s decode, %s prefill (chunks of %d tokens, CUDA graphs %s, %d tokens an iteration "
        "while streams decode%s), launch-ahead %s, max batch %d, context %d tokens, speculative decoding %s",
        name,
        engine.backend,
        engine.prefill,
        engine.prefill_chunk,
        " and ".join(kind for kind, on in graphs if on) or "off",
        engine.decode_prefill_budget,
        _slices(engine),
        "on" if engine.launch_ahead else "off",
        engine.max_batch,
        engine.max_context,
        f"up to {engine.max_draft} draft tokens a step" if engine.max_draft else "off",
    )
    return ServerState(
        engine,
        tokenizer,
        name,
        api_key=args.api_key,
        protect_metrics=args.protect_metrics,
        allowed_origins=args.allowed_origins,
        max_body_bytes=args.max_body_mb * 2**20,
        body_timeout=args.body_timeout,
        stats_interval=args.stats_interval,
        token_healing=args.token_healing == "on",
    )


def _slices(engine) -> str:
    """The ready line's words on the sliced prefill."""
    if not engine.sliced_prefill:
        return ""
    whole = engine.whole_chunk_tokens
    return ", in layer slices" + (f" (a lone chunk of up to {whole} tokens at once)" if whole else "")


def _synthetic(device: torch.device):
    from mk.config import ModelConfig
    from mk.model import synthetic_weights
    from mk.model.reference import Model
    from mk.tokenizer import Tokenizer

    cfg = ModelConfig.real()
    log.info("generating full-size random weights on %s", device)
    model = Model(cfg, synthetic_weights(cfg, seed=0, device=device, dtype=torch.bfloat16, std=0.01))
    return model, Tokenizer.builtin(cfg.vocab_size)


if __name__ == "__main__":
    main()
