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
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch

from mk.engine import options
from mk.server.app import App
from mk.server.http import BODY_TIMEOUT_S
from mk.server.serve import check_port, run
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
    # The engine's options (mk.engine.options.EngineOptions), a flag each.
    engine = p.add_argument_group("engine", "how the engine runs the model (mk.engine.options.EngineOptions)")
    options.add_arguments(engine)
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
    try:
        options.from_arguments(args)
    except ValueError as e:  # a combination of engine flags that cannot run, told in the flags' words
        p.error(options.in_flags_words(str(e)))
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
    run(App(state), args.host, args.port, args.drain_timeout, args.log_level == "debug")


def build_state(args: argparse.Namespace) -> ServerState:
    from mk.engine.engine import Engine
    from mk.model import load
    from mk.text.tokenizer import Tokenizer

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
        default_context = int(tokenizer.config.get("model_max_length") or options.SERVER_MAX_CONTEXT)
    elif args.synthetic:
        model, tokenizer = _synthetic(device)
        name, default_context = args.served_model_name or "north-mini-code-synthetic", options.SYNTHETIC_MAX_CONTEXT
    else:
        from mk.default_model import NAME, load_default

        model, tokenizer = load_default(device, dtype)
        name, default_context = args.served_model_name or NAME, options.SERVER_MAX_CONTEXT
    max_context = args.max_context or min(default_context, 1 << 20)
    engine = Engine(
        model,
        options.from_arguments(
            args,
            max_context=max_context,
            fit_context=args.max_context is None,  # (a context asked for is an error where it cannot fit)
            tokenizer_json=tokenizer.hf.to_str(),  # constrained requests compile against its vocabulary
            progress=progress,
        ),
    )
    if args.token_healing == "on":
        from mk.text.healing import warm_up

        warm_up(tokenizer)
    o = engine.options
    graphs = (("of fresh prompts", o.prefill_graphs), ("after a cached prefix", o.prefix_graphs))
    log.info(
        "engine ready: %s, %s decode, %s prefill (chunks of %d tokens, CUDA graphs %s, %d tokens an iteration "
        "while streams decode%s), launch-ahead %s, max batch %d, context %d tokens, speculative decoding %s",
        name,
        o.backend,
        o.prefill,
        o.prefill_chunk,
        " and ".join(kind for kind, on in graphs if on) or "off",
        o.decode_prefill_budget,
        _slices(o),
        "on" if o.launch_ahead else "off",
        o.max_batch,
        o.max_context,
        f"up to {o.max_draft} draft tokens a step" if o.max_draft else "off",
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


def _slices(o: options.EngineOptions) -> str:
    """The ready line's words on the sliced prefill."""
    if not o.sliced_prefill:
        return ""
    whole = o.whole_chunk_tokens
    return ", in layer slices" + (f" (a lone chunk of up to {whole} tokens at once)" if whole else "")


def _synthetic(device: torch.device):
    from mk.config import ModelConfig
    from mk.model import synthetic_weights
    from mk.model.reference import Model
    from mk.text.tokenizer import Tokenizer

    cfg = ModelConfig.real()
    log.info("generating full-size random weights on %s", device)
    model = Model(cfg, synthetic_weights(cfg, seed=0, device=device, dtype=torch.bfloat16, std=0.01))
    return model, Tokenizer.builtin(cfg.vocab_size)


if __name__ == "__main__":
    main()
