"""The corpus: source files split into training, validation and held-out files, and the functions fit for
the completion test (`Function`, `Corpus`, `build_corpus` on the standard library, `build_site_corpus` on
installed packages)."""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "__pycache__"})
HOLDOUT_SALT = b"mk-embedded-holdout:"
BODY_LINES = (2, 30)  # body lines (after the docstring) of a function fit for the completion test
PROMPT_LINES = 30  # at most this many signature + docstring lines
VAL_FRACTION = 0.02
PER_FILE = 4  # test functions taken from one held-out file at most (variety)
SITE = "site-packages"  # Corpus.root of build_site_corpus's corpora


@dataclass(frozen=True)
class Function:
    """A function fit for the completion test, dedented to column 0: `prompt` (decorators, signature and
    docstring, ending with a newline) + `body` (the rest, ending with a newline) is its source."""

    path: str  # relative to the library root, '/'-separated
    name: str
    lineno: int
    prompt: str
    body: str

    @property
    def source(self) -> str:
        return self.prompt + self.body

    def prompt_forms(self) -> dict[str, str]:
        """The completion prompt as users type it: ending at the docstring's closing quotes, after its
        newline, and after the next line's indentation (the body's first line's)."""
        indent = re.match(r"[ \t]*", self.body).group(0)
        return {"quotes": self.prompt.removesuffix("\n"), "newline": self.prompt, "indent": self.prompt + indent}


@dataclass
class Corpus:
    root: str
    train: dict[str, str]  # path -> text
    val: dict[str, str]
    heldout: dict[str, str]
    test_functions: list[Function]  # the held-out functions of the completion test
    train_functions: list[Function]  # fit functions of the training files (chat examples)
    leak_excluded: list[str] = field(default_factory=list)  # training files dropped for a held-out copy


def holdout_key(path: str) -> str:
    return hashlib.sha256(HOLDOUT_SALT + path.encode()).hexdigest()


def list_sources(root: Path) -> list[str]:
    """Relative paths of the library's .py files outside test folders, site-packages and pydoc_data."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_") or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def read_source(path: Path) -> str | None:
    """The file's text with '\\n' line ends, or None when it is not UTF-8 or does not parse here."""
    try:
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
        return None
    return text


def extract_functions(path: str, text: str) -> list[Function]:
    """The functions (and methods) of a source file fit for the completion test, in source order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
            continue
        if len(node.body) < 2 or node.body[1].lineno <= node.body[0].end_lineno:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        head = lines[first - 1 : node.body[0].end_lineno]
        body = lines[node.body[0].end_lineno : node.end_lineno]
        if len(head) > PROMPT_LINES or not BODY_LINES[0] <= sum(1 for x in body if x.strip()) <= BODY_LINES[1]:
            continue
        source = textwrap.dedent("\n".join(head + body) + "\n")
        try:
            parsed = ast.parse(source)
        except SyntaxError:
            continue  # a docstring or string literal below the def's indentation: dedent broke it
        if len(parsed.body) != 1 or not isinstance(parsed.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        src_lines = source.split("\n")
        prompt = "\n".join(src_lines[: len(head)]) + "\n"
        found.append(Function(path, node.name, node.lineno, prompt, source[len(prompt) :]))
    return sorted(found, key=lambda f: f.lineno)


def _normalise(text: str) -> str:
    """Whitespace-insensitive form for the leak check: each line stripped, blank lines dropped."""
    return "\n".join(s for s in (x.strip() for x in text.split("\n")) if s)


def first_files(
    texts: dict, max_files: int | None, max_bytes: int | None, drop: Callable[[str], bool] | None = None
) -> tuple[dict, list]:
    """The first files of `texts` (in its order), at most `max_files` of them and `max_bytes` in all,
    leaving out (and listing) those `drop` refuses; files past the caps are not looked at."""
    kept: dict = {}
    dropped = []
    size = 0
    for path, text in texts.items():
        if (max_files is not None and len(kept) >= max_files) or (
            max_bytes is not None and size + len(text) > max_bytes
        ):
            break
        if drop is not None and drop(text):
            dropped.append(path)
            continue
        kept[path] = text
        size += len(text)
    return kept, dropped


def build_corpus(
    root: str | Path, heldout: int = 100, max_files: int | None = None, max_bytes: int | None = None
) -> Corpus:
    """Split the library at `root` into training, validation and held-out files (see the module doc).

    Deterministic: depends only on the files' paths and contents. `max_files` keeps the first that many
    training files in hash order (quick runs); the held-out and validation sets do not change with it.
    """
    root = Path(root)
    order = sorted(list_sources(root), key=holdout_key)
    texts: dict[str, str] = {}
    held: dict[str, str] = {}
    tests: list[Function] = []
    i = 0
    while len(tests) < heldout and i < len(order):
        path = order[i]
        i += 1
        text = read_source(root / path)
        if text is None:
            continue
        fit = sorted(extract_functions(path, text), key=lambda f: holdout_key(f"{f.path}:{f.lineno}"))
        if fit:
            held[path] = text
            tests.extend(fit[: min(PER_FILE, heldout - len(tests))])
    if len(tests) < heldout:
        raise ValueError(f"{root}: only {len(tests)} functions fit for the completion test, {heldout} wanted")

    rest = [p for p in order[i:]]
    total = sum((root / p).stat().st_size for p in rest)
    val: dict[str, str] = {}
    val_bytes = 0
    j = 0
    while j < len(rest) and val_bytes < VAL_FRACTION * total:
        text = read_source(root / rest[j])
        if text is not None:
            val[rest[j]] = text
            val_bytes += len(text)
        j += 1
    candidates = rest[j:]
    if max_files is not None:
        candidates = candidates[: 2 * max_files]  # a margin for unreadable and leaking files
    for path in candidates:
        text = read_source(root / path)
        if text is not None:
            texts[path] = text

    # Leak guard: a training file holding a copy of a held-out function is dropped.
    needles = [_normalise(f.source) for f in tests]
    excluded = []
    for path in list(texts):
        hay = _normalise(texts[path])
        if any(n in hay for n in needles):
            excluded.append(path)
            del texts[path]
    texts = first_files(texts, max_files, max_bytes)[0]
    train_functions = [f for path, text in texts.items() for f in extract_functions(path, text)]
    return Corpus(str(root), texts, val, held, tests, train_functions, excluded)


def pick_test_functions(files: dict[str, str], count: int) -> list[Function]:
    """Up to `count` functions fit for the completion test from `files` (path -> text): files in hash
    order, at most PER_FILE from one, picked by hash."""
    found: list[Function] = []
    for path in sorted(files, key=holdout_key):
        fit = sorted(extract_functions(path, files[path]), key=lambda f: holdout_key(f"{f.path}:{f.lineno}"))
        found.extend(fit[: min(PER_FILE, count - len(found))])
        if len(found) >= count:
            break
    return found


def code_corpus():
    """scripts/code_corpus.py, imported by name (once: its worker processes pickle its functions by name)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import code_corpus

    return code_corpus


def build_site_corpus(
    packages: list,
    held_out: set[str],
    heldout: int,
    max_files: int | None = None,
    workers: int = 1,
    max_bytes: int | None = None,
) -> tuple[Corpus, dict]:
    """The corpus of installed packages (scripts/code_corpus.py: deduplicated, tests and generated files
    dropped) with whole packages held out: their functions are the completion test, their files the
    held-out loss set; the first training files in hash order, up to 2% of the bytes, are the validation
    set. Returns the corpus and code_corpus's manifest."""
    built = code_corpus().build(packages, held_out, workers)
    held = {path: text for texts in built.held_out.values() for path, text in texts.items()}
    tests = pick_test_functions(held, heldout)
    if len(tests) < heldout:
        raise ValueError(f"held-out packages give only {len(tests)} functions fit for the completion test")
    order = sorted(built.train, key=holdout_key)
    total = sum(len(built.train[p]) for p in order)
    val: dict[str, str] = {}
    j = val_bytes = 0
    while j < len(order) and val_bytes < VAL_FRACTION * total:
        val[order[j]] = built.train[order[j]]
        val_bytes += len(val[order[j]])
        j += 1
    needles = [_normalise(f.source) for f in tests]  # a held-out function copied inside a larger file
    # The leak check stops with the caps: it scans every byte it is given.
    texts, excluded = first_files(
        {p: built.train[p] for p in order[j:]}, max_files, max_bytes, lambda t: any(n in _normalise(t) for n in needles)
    )
    train_functions = [f for path, text in texts.items() for f in extract_functions(path, text)]
    corpus = Corpus(SITE, texts, val, held, tests, train_functions, excluded)
    return corpus, built.manifest
