"""The table of the results of record, generated from every benches/results/<card>.json
(scripts/record_results.py writes them): one column a card, one row a point of record, written
between the markers of README.md and docs/PERF.md so that the figures a reader sees are the data's.

  python scripts/results_table.py            write the table into README.md and docs/PERF.md
  python scripts/results_table.py --check    exit 1 where either document's table is not what the data gives
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benches"))  # cards.py: the cards and their bandwidths, without torch
from cards import HBM_BYTES_PER_S  # noqa: E402

RESULTS_DIR = REPO / "benches" / "results"
README = REPO / "README.md"
PERF = REPO / "docs" / "PERF.md"
# The documents that carry the table, each between the markers.
DOCS = (README, PERF)
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_MEASURED = "not measured"
DOES_NOT_FIT = "does not fit"
# The points of record: the decode grid's (batch, context), the engine's decode batches at its
# context, the prompts whose time to first token is shown, and the prompt admitted beside a stream.
DECODE_POINTS = ((1, 8192), (8, 8192), (16, 8192), (1, 262144))
ENGINE_DECODE_BATCHES = (1, 8)
ENGINE_DECODE_CTX = 8192
TTFT_PROMPTS = (512, 2048, 8192)
ADMIT_PROMPT = 32768
# Speculative decoding's verification steps of record: (batch, draft tokens a sequence) at 8K.
SPECULATIVE_POINTS = ((1, 4), (1, 8), (4, 3))
SPECULATIVE_CTX = 8192


def results_path(card: str, results_dir: Path = RESULTS_DIR) -> Path:
    """Where a card's results of record live: benches/results/h100.json for the H100."""
    return results_dir / f"{card.lower()}.json"


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    """Every card's results of record, by card (a card with no file is absent); a file named for no
    known card is an error rather than a column nobody asked for."""
    known = {results_path(card, results_dir).name: card for card in HBM_BYTES_PER_S}
    results = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.name not in known:
            raise ValueError(f"{path}: not a card's results (expected one of {', '.join(sorted(known))})")
        results[known[path.name]] = json.loads(path.read_text())
    return results


def table(results: dict[str, dict]) -> str:
    """The markdown table: a row a point of record, a column a card."""
    cards = list(HBM_BYTES_PER_S)
    lines = ["| | " + " | ".join(cards) + " |", "|---" * (len(cards) + 1) + "|"]
    for label, cell in _rows():
        lines.append(f"| {label} | " + " | ".join(cell(results.get(card, {})) for card in cards) + " |")
    return "\n".join(lines)


def _rows():
    """(label, the cell a card's results give) for each row of the table."""
    for batch, ctx in DECODE_POINTS:
        yield f"decode step, batch {batch} × {_k(ctx)}", lambda r, p=(batch, ctx): _decode_cell(r, *p)
    for batch in ENGINE_DECODE_BATCHES:
        label = f"engine decode, batch {batch} × {_k(ENGINE_DECODE_CTX)}"
        yield label, lambda r, b=batch: _engine_decode_cell(r, b)
    for prompt in TTFT_PROMPTS:
        yield f"time to first token, {_k(prompt)}-token prompt", lambda r, n=prompt: _ttft_cell(r, n)
    label = f"longest pause of a stream while a {_k(ADMIT_PROMPT)}-token prompt is admitted"
    yield label, _admit_cell
    for batch, drafts in SPECULATIVE_POINTS:
        label = f"verification step, batch {batch} × {_k(SPECULATIVE_CTX)}, {drafts} draft tokens a sequence"
        yield label, lambda r, b=batch, k=drafts: _speculative_cell(r, b, k)
    yield "commit (date)", _runs_cell


def _decode_cell(results: dict, batch: int, ctx: int) -> str:
    """mk's step time, tokens/s and SOL fraction at the point, and how many times faster than the
    yardstick's CUDA graph it is."""
    mk = _median_process(_points(results, "decode", batch, ctx))
    if not isinstance(mk, dict):
        return mk
    cell = f"{_ms(mk['mk_ms'])}, {mk['mk_tok_s']:.0f} tok/s, {mk['sol_fraction']:.2f} of SOL"
    yardstick = _points(results, "yardstick", batch, ctx)
    timed = [r["graph_ms"] for r in yardstick if r.get("graph_ms") is not None]
    if timed:
        return f"{cell}, {timed[-1] / mk['mk_ms']:.2f}× the yardstick"
    return f"{cell} (yardstick: {DOES_NOT_FIT})" if any("skipped" in r for r in yardstick) else cell


def _median_process(rows: list[dict]) -> dict | str:
    """The point's row from the median process (the lower middle of an even count) among those that
    timed it, as scripts/device-grid.sh's table shows it (its batch-1 chunk runs in several
    processes); else what the cell says instead."""
    timed = sorted((r for r in rows if r.get("mk_ms") is not None), key=lambda r: r["mk_ms"])
    if timed:
        return timed[(len(timed) - 1) // 2]
    return DOES_NOT_FIT if any("skipped" in r for r in rows) else NOT_MEASURED


def _engine_decode_cell(results: dict, batch: int) -> str:
    """All streams' tokens per second together, through the engine's Python API."""
    row = _engine_row(results, "decode", batch=batch, ctx=ENGINE_DECODE_CTX)
    return row if isinstance(row, str) else f"{row['aggregate_tok_s']:.0f} tok/s"


def _ttft_cell(results: dict, prompt: int) -> str:
    row = _engine_row(results, "ttft", prompt=prompt)
    return row if isinstance(row, str) else _ms(row["ttft_ms"])


def _admit_cell(results: dict) -> str:
    """The longest gap between a decoding stream's tokens while the long prompt is admitted."""
    row = _engine_row(results, "admit", prompt=ADMIT_PROMPT)
    if isinstance(row, str):
        return row
    return NOT_MEASURED if row.get("longest_gap_ms") is None else _ms(row["longest_gap_ms"])


def _speculative_cell(results: dict, batch: int, drafts: int) -> str:
    """Tokens per second against the plain step's of the same run, every draft accepted and none."""
    rows = _points(results, "speculative", batch, SPECULATIVE_CTX)
    row = next((r for r in rows if r.get("K") == drafts and r.get("step_ms") is not None), None)
    if row is None:
        return DOES_NOT_FIT if any("skipped" in r for r in rows) else NOT_MEASURED
    all_, none = row["speedup_all"], row["speedup_none"]
    return f"{_ms(row['step_ms'])}: {all_:.2f}× the plain step all accepted, {none:.2f}× none"


def _runs_cell(results: dict) -> str:
    """The commit and date of the card's runs of record, with the benchmarks of each where they differ."""
    runs: dict[str, list[str]] = {}
    for name, entry in sorted(results.items()):
        runs.setdefault(f"{entry['commit'][:7]} ({entry['date']})", []).append(name)
    if len(runs) <= 1:
        return next(iter(runs), NOT_MEASURED)
    return "; ".join(f"{run}: {', '.join(names)}" for run, names in runs.items())


def _points(results: dict, benchmark: str, batch: int, ctx: int) -> list[dict]:
    """A grid benchmark's rows at one point (the yardstick names the batch `B`)."""
    rows = results.get(benchmark, {}).get("rows", [])
    return [r for r in rows if r.get("batch", r.get("B")) == batch and r.get("ctx") == ctx]


def _engine_row(results: dict, kind: str, **point) -> dict | str:
    """benches/engine.py's first row of a kind at a point (a fresh prompt where `cached` is
    recorded), or what the cell says instead."""
    for r in results.get("engine", {}).get("rows", []):
        if r["row"] == kind and all(r.get(k) == v for k, v in point.items()) and not r.get("cached"):
            return DOES_NOT_FIT if "skipped" in r else r
    return NOT_MEASURED


def _k(tokens: int) -> str:
    """A context or prompt length as the grid names it: 8192 is `8K`."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _ms(v: float) -> str:
    return f"{v:.3g} ms" if v < 100 else f"{v:.0f} ms"


def with_table(text: str, results: dict[str, dict]) -> str:
    """A document's text with the table between its markers generated again from `results`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no `{BEGIN}` ... `{END}` markers for the results table")
    return f"{text[: start + len(BEGIN)]}\n{table(results)}\n{text[end:]}"


def write_docs(docs: Sequence[Path] = DOCS, results_dir: Path = RESULTS_DIR) -> None:
    """Every document's table generated again from the results of record (none is written unless
    every one has the markers)."""
    texts = _with_tables(docs, load_results(results_dir))
    for doc, (_, new) in texts.items():
        doc.write_text(new)


def docs_out_of_step(docs: Sequence[Path] = DOCS, results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The documents whose table is not what the results of record give."""
    return [doc for doc, (old, new) in _with_tables(docs, load_results(results_dir)).items() if old != new]


def _with_tables(docs: Sequence[Path], results: dict[str, dict]) -> dict[Path, tuple[str, str]]:
    """Each document's text as it is and with its table generated again."""
    texts = {}
    for doc in docs:
        text = doc.read_text()
        try:
            texts[doc] = (text, with_table(text, results))
        except ValueError as e:
            raise ValueError(f"{doc}: {e}") from e
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 where a document's table differs from the data")
    parser.add_argument(
        "--doc",
        type=Path,
        action="append",
        help="a document that carries the table, repeatable (default: README.md and docs/PERF.md)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the folder of <card>.json files")
    args = parser.parse_args(argv)
    docs = args.doc or DOCS
    try:
        if args.check:
            stale = docs_out_of_step(docs, args.results)
            for doc in stale:
                print(f"{doc}: the results table is not what {args.results} gives; run scripts/results_table.py")
            return 1 if stale else 0
        write_docs(docs, args.results)
    except (OSError, ValueError) as e:
        print(f"results_table: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
