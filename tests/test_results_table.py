"""The results of record (benches/results/<card>.json) and the table generated from them into
README.md and docs/PERF.md: scripts/record_results.py turns a device call's files into a card's
entries, scripts/results_table.py the entries into the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(REPO / "scripts"))  # the scripts import each other by name
import record_results as rr  # noqa: E402
import results_table as rt  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
README = f"# mk\n\n## Results of record\n\n{rt.BEGIN}\nstale\n{rt.END}\n\n## The server\n"
PERF = f"# mk performance\n\n## Results of record\n\nText.\n\n{rt.BEGIN}\n{rt.END}\n\n## Tuning decisions\n"


def docs(tmp_path: Path) -> tuple[Path, Path]:
    """A README and a PERF.md with stale tables, in tmp_path."""
    readme, perf = tmp_path / "README.md", tmp_path / "PERF.md"
    readme.write_text(README)
    perf.write_text(PERF)
    return readme, perf


def doc_args(*paths: Path) -> list[str]:
    return [arg for path in paths for arg in ("--doc", str(path))]


def test_the_tables_are_what_the_results_of_record_give():
    """README's and PERF.md's tables are regenerated from benches/results/*.json, not edited by hand
    (`python scripts/results_table.py` writes them again)."""
    assert {p.relative_to(REPO).as_posix() for p in rt.DOCS} == {"README.md", "docs/PERF.md"}
    assert rt.docs_out_of_step() == [], "run `python scripts/results_table.py` after changing benches/results/"
    assert rt.main(["--check"]) == 0
    tables = [rt.table(rt.load_results()) in doc.read_text() for doc in rt.DOCS]
    assert tables == [True, True]


def test_check_fails_where_either_table_is_not_the_datas(tmp_path, capsys):
    readme, perf = docs(tmp_path)
    assert rt.main(["--check", *doc_args(readme, perf)]) == 1
    assert rt.docs_out_of_step([readme, perf]) == [readme, perf]
    assert rt.main(doc_args(readme, perf)) == 0  # written from the data
    assert rt.main(["--check", *doc_args(readme, perf)]) == 0
    assert rt.table(rt.load_results()) in readme.read_text() and rt.table(rt.load_results()) in perf.read_text()
    assert perf.read_text().startswith("# mk performance\n") and perf.read_text().endswith("## Tuning decisions\n")

    edited = perf.read_text().replace(rt.END, f"| edited by hand | 1 ms | 1 ms |\n{rt.END}")
    perf.write_text(edited)
    capsys.readouterr()
    assert rt.docs_out_of_step([readme, perf]) == [perf]
    assert rt.main(["--check", *doc_args(readme, perf)]) == 1
    assert str(perf) in capsys.readouterr().out
    assert rt.main(doc_args(readme, perf)) == 0  # written again
    assert rt.docs_out_of_step([readme, perf]) == []


def test_a_document_without_markers_is_an_error_and_nothing_is_written(tmp_path, capsys):
    readme, perf = docs(tmp_path)
    perf.write_text("# mk performance\n\nno table here\n")
    assert rt.main(doc_args(readme, perf)) == 2
    assert f"{perf}: no `{rt.BEGIN}`" in capsys.readouterr().err
    assert readme.read_text() == README  # not written either
    assert rt.main(["--check", *doc_args(readme, perf)]) == 2


def decode_row(batch: int, ctx: int, mk_ms: float) -> dict:
    return {"batch": batch, "ctx": ctx, "mk_ms": mk_ms, "mk_tok_s": batch / mk_ms * 1e3, "sol_fraction": 1.2 / mk_ms}


def grid_json(path: Path, gpu: str = "NVIDIA H100 80GB HBM3") -> Path:
    """A device-final.sh grid.json: batch 1 at 8K from three processes, batch 8 at 8K, 16 x 8K that
    did not fit, and the yardstick's lines (an environment line first, batch as `B` or `batch`)."""
    skipped = {"batch": 16, "ctx": 8192, "skipped": "out of memory on this card"}
    decode = [decode_row(1, 8192, 3.0), decode_row(8, 8192, 10.0), decode_row(1, 8192, 2.0), skipped]
    decode.append(decode_row(1, 8192, 2.5))  # the median process of the three
    yardstick = [{"torch": "2.11", "gpu": gpu, "grouped_mm": True, "copy_TBps": 3.0}]
    yardstick += [{"B": 1, "ctx": 8192, "graph_ms": 10.0}, {"batch": 8, "ctx": 8192, "graph_ms": 15.0}]
    yardstick.append({"B": 1, "ctx": 262144, "skipped": "out of memory on this card"})
    grid = {"sol_card": "H100", "sol_bytes_per_s": 3.35e12, "decode": decode, "yardstick": yardstick}
    path.write_text(json.dumps(grid))
    return path


def engine_json(path: Path, device: str = "NVIDIA H100 80GB HBM3") -> Path:
    """benches/engine.py's record (common.write_json): decode, ttft and admit rows, one skipped."""
    rows = [
        {"row": "ttft", "prompt": 512, "cached": 0, "ttft_ms": 30.04},
        {"row": "ttft", "prompt": 2048, "skipped": "out of memory on this card"},
        {"row": "reuse", "prompt": 8448, "cached": 8128, "ttft_ms": 40.0},
        {"row": "ttft", "prompt": 8192, "cached": 0, "ttft_ms": 201.4},
        {"row": "decode", "batch": 1, "ctx": 8192, "aggregate_tok_s": 350.4},
        {"row": "admit", "prompt": 32768, "cached": 0, "ttft_ms": 1400.0, "longest_gap_ms": 41.26},
        {"row": "admit", "prompt": 9192, "cached": 8128, "ttft_ms": 200.0, "longest_gap_ms": 99.0},
    ]
    record = {"benchmark": "engine", "device": device, "host": "vm", "engine_start_s": 40.0}
    record["settings"] = {"json": "/root/out/engine.json", "quick": False}
    path.write_text(json.dumps({**record, "rows": rows}))
    return path


def cells(text: str, card: str) -> dict[str, str]:
    """The cells of one card's column of the table in `text`, by row label."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    column = rows[0].index(card)
    return {row[0]: row[column] for row in rows[2:]}


def test_a_device_runs_files_become_the_cards_results_and_its_column(tmp_path):
    results = tmp_path / "results"
    readme, perf = docs(tmp_path)
    files = [grid_json(tmp_path / "grid.json"), engine_json(tmp_path / "engine.json")]
    argv = ["--commit", COMMIT, "--date", "2026-12-07", "--results", str(results), *doc_args(readme, perf)]
    assert rr.main([*argv, *map(str, files)]) == 0

    assert [p.name for p in results.iterdir()] == ["h100.json"]
    data = json.loads((results / "h100.json").read_text())
    assert sorted(data) == ["decode", "engine", "yardstick"]
    for entry in data.values():
        assert (entry["commit"], entry["card"], entry["date"]) == (COMMIT, "NVIDIA H100 80GB HBM3", "2026-12-07")
    assert data["decode"]["rows"] == json.loads(files[0].read_text())["decode"]  # skipped rows as they are
    assert data["decode"]["sol_bytes_per_s"] == 3.35e12
    assert [r.get("B", r.get("batch")) for r in data["yardstick"]["rows"]] == [1, 8, 1]
    assert data["yardstick"]["environment"][0]["copy_TBps"] == 3.0
    assert data["engine"]["engine_start_s"] == 40.0 and data["engine"]["settings"] == {"quick": False}
    assert "host" not in data["engine"] and "benchmark" not in data["engine"]

    h100, h200 = cells(readme.read_text(), "H100"), cells(readme.read_text(), "H200")
    assert h100["decode step, batch 1 × 8K"] == "2.5 ms, 400 tok/s, 0.48 of SOL, 4.00× the yardstick"
    assert h100["decode step, batch 8 × 8K"] == "10 ms, 800 tok/s, 0.12 of SOL, 1.50× the yardstick"
    assert h100["decode step, batch 16 × 8K"] == "does not fit"
    assert h100["decode step, batch 1 × 256K"] == "not measured"
    assert h100["engine decode, batch 1 × 8K"] == "350 tok/s"
    assert h100["engine decode, batch 8 × 8K"] == "not measured"
    assert h100["time to first token, 512-token prompt"] == "30 ms"
    assert h100["time to first token, 2K-token prompt"] == "does not fit"
    assert h100["time to first token, 8K-token prompt"] == "201 ms"
    assert h100["longest pause of a stream while a 32K-token prompt is admitted"] == "41.3 ms"
    assert h100["commit (date)"] == "0123456 (2026-12-07)"
    assert set(h200.values()) == {"not measured"}
    assert cells(perf.read_text(), "H100") == h100 and cells(perf.read_text(), "H200") == h200
    assert rt.docs_out_of_step([readme, perf], results) == []


def test_a_later_run_replaces_only_its_own_benchmarks(tmp_path):
    results = tmp_path / "results"
    rr.record([grid_json(tmp_path / "grid.json"), engine_json(tmp_path / "engine.json")], COMMIT, "2026-12-07", results)
    later = "f" * 40
    engine = engine_json(tmp_path / "engine2.json", device="NVIDIA H100 PCIe")
    rr.record([engine], later, "2026-12-08", results)
    data = json.loads((results / "h100.json").read_text())
    assert (data["decode"]["commit"], data["engine"]["commit"]) == (COMMIT, later)
    assert data["engine"]["card"] == "NVIDIA H100 PCIe"
    runs = cells(rt.table(rt.load_results(results)), "H100")["commit (date)"]
    assert runs == "0123456 (2026-12-07): decode, yardstick; fffffff (2026-12-08): engine"


def test_a_yardstick_skipped_where_mk_ran_says_so(tmp_path):
    results = tmp_path / "results"
    grid = {"device": "NVIDIA H200", "decode": [decode_row(1, 262144, 4.0)]}
    grid["yardstick"] = [{"B": 1, "ctx": 262144, "skipped": "out of memory on this card"}]
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    rr.record([tmp_path / "grid.json"], COMMIT, "2026-12-07", results)
    cell = cells(rt.table(rt.load_results(results)), "H200")["decode step, batch 1 × 256K"]
    assert cell == "4 ms, 250 tok/s, 0.30 of SOL (yardstick: does not fit)"


@pytest.mark.parametrize(
    "content, error",
    [
        (None, "cannot read it"),
        ("{not json", "cannot read it"),
        (json.dumps({"benchmark": "engine", "device": "Tesla V100-SXM2-32GB", "rows": []}), "cannot tell one card"),
        (json.dumps({"benchmark": "engine", "device": None, "rows": []}), "names no device"),
        (json.dumps({"decode": [decode_row(1, 8192, 2.0)], "yardstick": []}), "names no device"),
        (json.dumps({"device": "NVIDIA H100", "decode": [], "yardstick": [{"gpu": "NVIDIA H200"}]}), "one card"),
        (json.dumps({"benchmark": "prefill-profile", "device": "NVIDIA H200", "rows": []}), "no benchmark of record"),
        (json.dumps({"rows": []}), "neither a grid.json"),
        (json.dumps({"benchmark": "engine", "device": "NVIDIA H200", "rows": [1, 2]}), "not a list of objects"),
    ],
)
def test_a_file_that_cannot_be_recorded_is_an_error_and_nothing_is_written(tmp_path, capsys, content, error):
    results = tmp_path / "results"
    readme, perf = docs(tmp_path)
    good, bad = engine_json(tmp_path / "engine.json"), tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    with pytest.raises(rr.RecordError, match=error):
        rr.record([good, bad], COMMIT, "2026-12-07", results)
    argv = ["--commit", COMMIT, "--results", str(results), *doc_args(readme, perf), str(good), str(bad)]
    assert rr.main(argv) == 2
    assert error in capsys.readouterr().err
    assert not results.exists() and readme.read_text() == README and perf.read_text() == PERF


@pytest.mark.parametrize("commit, date", [("29bea27", "2026-12-07"), (COMMIT, "07/12/2026")])
def test_the_commit_is_a_full_sha_and_the_date_a_day(tmp_path, commit, date):
    with pytest.raises(rr.RecordError, match="--commit|--date"):
        rr.record([engine_json(tmp_path / "engine.json")], commit, date, tmp_path / "results")


def test_a_speculative_run_gives_its_verification_rows(tmp_path):
    rows = [
        {"batch": 1, "ctx": 8192, "K": 0, "step_ms": 3.0, "speedup_all": 1.0, "speedup_none": 1.0},
        {"batch": 1, "ctx": 8192, "K": 4, "step_ms": 7.5, "speedup_all": 2.0, "speedup_none": 0.4},
        {"batch": 4, "ctx": 8192, "K": 3, "skipped": "out of memory on this card"},
    ]
    path = tmp_path / "speculative.json"
    path.write_text(json.dumps({"benchmark": "speculative", "device": "NVIDIA H100 80GB HBM3", "rows": rows}))
    results = tmp_path / "results"
    rr.record([path], COMMIT, "2026-12-07", results)
    h100 = cells(rt.table(rt.load_results(results)), "H100")
    assert h100["verification step, batch 1 × 8K, 4 draft tokens a sequence"] == (
        "7.5 ms: 2.00× the plain step all accepted, 0.40× none"
    )
    assert h100["verification step, batch 1 × 8K, 8 draft tokens a sequence"] == "not measured"
    assert h100["verification step, batch 4 × 8K, 3 draft tokens a sequence"] == "does not fit"
