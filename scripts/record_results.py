"""Records a device run as the results of record, here, after the call: the files that came back
replace their benchmarks' entries in benches/results/<card>.json (the card told by the device names
the files hold), and the table of README.md and docs/PERF.md is generated again
(scripts/results_table.py).

  python scripts/record_results.py --commit <full sha> [--date YYYY-MM-DD] FILE...

A file is one of
- scripts/device-final.sh's grid.json: {"decode": [rows], "yardstick": [lines]}, with the card's
  name and bandwidth where the decode records gave them;
- a benchmark's record (benches/common.py, write_json): {"benchmark", "device", "rows", ...};
- the yardstick of record's own list of lines.
The yardstick's lines are points (a batch, `B` or `batch`, and a context) and, first in each chunk,
one of its environment (the card, torch, the copy bandwidth), kept apart from the points. Rows of
points that did not fit the card ({"skipped": reason}) are kept as they are. Nothing is written
unless every file can be recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "benches")]  # results_table and cards, imported by name
import results_table  # noqa: E402

from cards import HBM_BYTES_PER_S, card_of  # noqa: E402

# The benchmarks whose latest run is of record, by the name their records give.
BENCHMARKS = ("decode", "yardstick", "engine", "prefill", "serve", "speculative")
# A benchmark record's keys that its entry holds otherwise (its name, the card, the rows) or not at
# all (the machine's host name).
RECORD_KEYS_NOT_KEPT = ("benchmark", "device", "host", "rows")
# The grid's keys that are its two benchmarks' rows rather than the decode record's metadata.
GRID_BENCHMARKS = ("decode", "yardstick")


class RecordError(Exception):
    """A file that cannot be recorded: unreadable, of no known shape, or of no known card."""


def runs_of(path: Path) -> tuple[str, dict[str, dict]]:
    """The device name a file's runs were on, and each of its benchmarks' run (metadata and rows);
    a benchmark with no rows in the file is left out."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"{path}: cannot read it as JSON ({e})") from e
    if isinstance(data, list):
        lines = _rows(path, data)
        names, runs = _yardstick_names(lines), {"yardstick": _yardstick_run(lines)}
    elif isinstance(data, dict) and "benchmark" in data:
        names, runs = [data.get("device")], {data["benchmark"]: _record_run(data)}
    elif isinstance(data, dict) and any(k in data for k in GRID_BENCHMARKS):
        meta = {k: v for k, v in data.items() if k not in ("device", *GRID_BENCHMARKS)}
        lines = _rows(path, data.get("yardstick", []))
        names = [data.get("device"), *_yardstick_names(lines)]
        runs = {"decode": {**meta, "rows": data.get("decode", [])}, "yardstick": _yardstick_run(lines)}
    else:
        raise RecordError(f"{path}: neither a grid.json, a benchmark's record nor the yardstick's lines")
    unknown = sorted(set(runs) - set(BENCHMARKS))
    if unknown:
        raise RecordError(f"{path}: {', '.join(unknown)} is no benchmark of record ({', '.join(BENCHMARKS)})")
    for run in runs.values():
        run["rows"] = _rows(path, run["rows"])
    return _device_name(path, names), {name: run for name, run in runs.items() if run["rows"]}


def _record_run(data: dict) -> dict:
    """A benchmark record's metadata worth keeping, and its rows (the path it was written to on the
    device machine is not worth keeping)."""
    meta = {k: v for k, v in data.items() if k not in RECORD_KEYS_NOT_KEPT}
    if isinstance(meta.get("settings"), dict):
        meta["settings"] = {k: v for k, v in meta["settings"].items() if k != "json"}
    return {**meta, "rows": data.get("rows")}


def _yardstick_run(lines: list[dict]) -> dict:
    """The yardstick's points as its rows, its environment lines apart."""
    points = [r for r in lines if "ctx" in r]
    environment = [r for r in lines if "ctx" not in r]
    return {"environment": environment, "rows": points} if environment else {"rows": points}


def _yardstick_names(lines: list[dict]) -> list:
    return [r.get("gpu") for r in lines if "ctx" not in r]


def _rows(path: Path, rows) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RecordError(f"{path}: its rows are not a list of objects")
    return rows


def _device_name(path: Path, names: list) -> str:
    """The one card the file's device names name (the first such name as the entry's card)."""
    names = [n for n in names if n]
    if not names:
        raise RecordError(f"{path}: names no device, so its card is unknown")
    cards = {card_of(n) for n in names}
    if None in cards or len(cards) > 1:
        known = ", ".join(HBM_BYTES_PER_S)
        raise RecordError(f"{path}: cannot tell one card ({known}) from its device names {sorted(set(names))}")
    return names[0]


def record(paths: list[Path], commit: str, date: str, results_dir: Path) -> list[Path]:
    """Each file's runs as its card's entries of record, replacing those benchmarks' earlier runs;
    returns the results files written."""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise RecordError(f"--commit {commit}: not a full commit sha (`git rev-parse HEAD` prints one)")
    try:
        datetime.date.fromisoformat(date)
    except ValueError as e:
        raise RecordError(f"--date {date}: not a YYYY-MM-DD date") from e
    by_card: dict[str, dict[str, dict]] = {}
    for path in paths:
        device, runs = runs_of(path)
        if not runs:
            print(f"{path}: no rows, nothing to record")
            continue
        entries = by_card.setdefault(card_of(device), {})
        for name, run in runs.items():
            if name in entries:
                raise RecordError(f"{path}: a second {name} run of the {card_of(device)} in one record")
            entries[name] = {"commit": commit, "card": device, "date": date, **run}
    written = []
    for card, entries in by_card.items():
        path = results_table.results_path(card, results_dir)
        results = json.loads(path.read_text()) if path.exists() else {}
        results.update(entries)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(results_json(dict(sorted(results.items()))))
        print(f"{path}: {', '.join(sorted(entries))} of {commit[:7]} ({date})")
        written.append(path)
    return written


def results_json(results: dict[str, dict]) -> str:
    """A card's results as JSON with one row a line, so that a new run's diff reads point by point."""
    entries = []
    for name, entry in results.items():
        fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items() if k != "rows"]
        rows = ",\n".join(f"   {json.dumps(r)}" for r in entry["rows"])
        fields.append(f'  "rows": [\n{rows}\n  ]')
        entries.append(f" {json.dumps(name)}: {{\n" + ",\n".join(fields) + "\n }")
    return "{\n" + ",\n".join(entries) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="what the device call wrote to $OUT")
    parser.add_argument("--commit", required=True, help="the full sha of the code the run measured")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="the run's day (default: today)")
    parser.add_argument("--results", type=Path, default=results_table.RESULTS_DIR, help="the folder of <card>.json")
    parser.add_argument(
        "--doc",
        type=Path,
        action="append",
        help="a document whose table is generated again, repeatable (default: README.md and docs/PERF.md)",
    )
    args = parser.parse_args(argv)
    try:
        record(args.files, args.commit, args.date, args.results)
        results_table.write_docs(args.doc or results_table.DOCS, args.results)
    except (RecordError, OSError, ValueError) as e:
        print(f"record_results: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
