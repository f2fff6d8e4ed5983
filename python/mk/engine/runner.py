"""The Python halves of the decode backends, called by the Rust decode loop with the GIL held:
`PrefillRunner` (the KV pool and PyTorch prefill every backend shares) and `PytorchRunner`, which
also decodes with the PyTorch model (`rust/python/pytorch_backend.rs`); the megakernel's
is `mk.megakernel.runner.MegakernelRunner`.

Rust owns the block ids; a runner owns the K/V tensors and a mirror of the dense page table,
patched with the rows Rust reports as changed. It returns logits as float32 numpy arrays and Rust
samples them. Prefill chunks run through `mk.prefill.packed.Prefill` when one is given (the engine's
choice on a GPU), else through the model's plain forward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mk.config import PAGE_SIZE
from mk.model.reference import Model
from mk.model.varlen import FLEX_BLOCK
from mk.prefill.packed import Prefill, PrefillRequest, SlicedPrefill

log = logging.getLogger("mk")

# On the CPU, a call of fewer tokens than this (every decode step, a short prompt) runs on one
# intra-op thread. The decode loop's thread is not the one that loaded the model, so its OpenMP
# team of workers comes on top of the main thread's; with more workers than cores libgomp spins
# only briefly, and each of a step's few hundred small parallel regions waits for sleeping workers
# to wake. Decode steps are then several times faster on one thread; a 512-token prompt takes
# about as long either way, longer ones gain from the threads (benches/cpu_engine.py; docs/PERF.md,
# tuning decisions).
SERIAL_TOKENS = 512
# The cached prefix of the warm-up's short chunk after one (16 rows pad to 2 flex blocks, their 16 +
# prefix keys to 3), and its pages.
WARM_PREFIX = 2 * FLEX_BLOCK
WARM_PREFIX_PAGES = WARM_PREFIX // PAGE_SIZE + 1


class PrefillRunner:
    """The model over a paged KV pool: prefill (and its warm-up); decode is each backend's own."""

    def __init__(
        self,
        model: Model,
        num_blocks: int,
        max_batch: int,
        max_context: int,
        packed_prefill: Prefill | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        self.model = model
        self.packed_prefill = packed_prefill
        # Most tokens of one prefill call (the engine's chunk; by default the packed prefill's).
        self.prefill_chunk = prefill_chunk or (packed_prefill.chunk if packed_prefill is not None else max_context)
        self.kv = model.new_kv(num_blocks)
        self.layers = model.config.num_hidden_layers
        self.max_pages = -(-max_context // PAGE_SIZE)
        # [row, layer, page] on the CPU: the model reads block tables per sequence.
        self.tables = torch.full((max_batch, self.layers, self.max_pages), -1, dtype=torch.int32)
        self.sliced: SlicedPrefill | None = None  # a layer-sliced prefill call in progress

    def warm_up(self, progress: bool = True) -> None:
        """Run the packed prefill on scratch pages before serving, so its first-call compilation (tens of
        seconds on a GPU) does not land on the first request; on a GPU also capture the CUDA graphs
        of fresh prompts and of chunks after a cached prefix (mk.prefill.static; the latter's long
        prefixes read scratch pages again and again), the largest of each kind first so that the
        others reuse its memory, then run one whole chunk the usual way, so that neither does the
        allocation of a full chunk's activations (a few GB; a capture empties the cache). Uses
        blocks from 0 on (`scratch_blocks` of them), which nothing holds yet and every later
        prefill overwrites before reading. With `progress`, a bar counts the passes where stderr is
        a terminal."""
        if self.packed_prefill is None:
            self._warm_up_plain()
            return
        if self.kv.num_blocks < self.layers:
            return
        started = time.perf_counter()
        fresh, prefixed = self.packed_prefill.fresh, self.packed_prefill.prefixed
        passes = self._warm_up_passes()
        bar = tqdm(total=len(passes), desc="prefill warm-up", unit="pass", disable=None if progress else True)
        # The log lines go above the bar while it shows.
        with bar, contextlib.nullcontext() if bar.disable else logging_redirect_tqdm():
            for note, run in passes:
                if note:
                    log.info(note)
                run()
                bar.update()
        for static, what in ((fresh, "fresh prompts"), (prefixed, "chunks after a cached prefix")):
            if static is not None and static.uncapturable():
                log.warning("%d shapes of %s could not be captured and run eagerly", static.uncapturable(), what)
        log.info("prefill warm-up done in %.1f s", time.perf_counter() - started)

    @staticmethod
    def scratch_blocks(cfg, chunk: int, max_context: int) -> int:
        """The blocks the warm-up uses (all of its passes run where the pool has as many)."""
        _, pages = _whole_chunk(chunk, -(-max_context // PAGE_SIZE))
        return cfg.num_hidden_layers * max(pages, 2, WARM_PREFIX_PAGES)

    def _warm_up_passes(self) -> list[tuple[str | None, Callable[[], object]]]:
        """The warm-up's prefill calls in order, each with the log line that opens its part (or None)."""
        prefill, fresh = self.packed_prefill, self.packed_prefill.fresh
        table = torch.full((self.layers, self.max_pages), -1, dtype=torch.int32)
        table[:, 0] = torch.arange(self.layers, dtype=torch.int32)
        n, pages = self._whole_chunk()
        whole = self.model.device.type == "cuda" and self.kv.num_blocks >= self.layers * pages
        if whole:
            chunk_table = torch.arange(self.layers * pages, dtype=torch.int32).view(self.layers, pages)
            chunk_table = torch.nn.functional.pad(chunk_table, (0, self.max_pages - pages), value=-1)
            aliased = self._scratch_table(pages)

        def call(requests: list[PrefillRequest], usual: bool = False) -> Callable[[], object]:
            def run():
                with _usual_path(prefill) if usual else contextlib.nullcontext():
                    prefill(requests, self.kv)

            return run

        # First the usual path, whatever the prompts' shapes: two lengths, so that dynamic-shape
        # compilation is settled too.
        compiling = "compiling the prefill path (torch.compile; the first start takes a while)"
        passes = [(compiling if prefill.compiled else None, call([PrefillRequest([0] * 16, 0, table)], True))]
        passes.append((None, call([PrefillRequest([0] * 48, 0, table)], True)))
        if self.kv.num_blocks >= 2 * self.layers:  # and a packed call of two sequences
            other = table.clone()
            other[:, 0] += self.layers
            passes.append((None, call([PrefillRequest([0] * 16, 0, table), PrefillRequest([0] * 32, 0, other)], True)))
        # And a chunk after a cached prefix whose keys pad to more flex blocks than its rows: every
        # call above has as many keys as rows, and the compiled flex attention, which sizes
        # equal dimensions alike, would likely compile again for the first such chunk: a first-use
        # pause of seconds, every decoding stream waiting.
        prefix, prefix_pages = WARM_PREFIX, WARM_PREFIX_PAGES
        if self.kv.num_blocks >= prefix_pages * self.layers and self.max_pages >= prefix_pages:
            prefix_table = torch.full_like(table, -1)
            blocks = torch.arange(prefix_pages * self.layers, dtype=torch.int32).view(prefix_pages, self.layers)
            prefix_table[:, :prefix_pages] = blocks.T
            passes.append((None, call([PrefillRequest([0] * 16, prefix, prefix_table)], True)))
        if whole and fresh is not None and fresh.capture:
            # One fresh prompt per padded length a prompt of up to n tokens can take, the largest first.
            sizes = sorted({min(size, n) for size in fresh.buckets}, reverse=True)
            note = f"capturing the prefill's CUDA graphs for fresh prompts of up to {sizes[0]} tokens"
            for i, m in enumerate(sizes):
                passes.append((None if i else note, call([PrefillRequest([0] * m, 0, chunk_table)])))
        prefixed = prefill.prefixed
        chunks = prefixed.warm_up_chunks(self.max_pages * PAGE_SIZE)[::-1] if prefixed is not None else []
        if prefixed is not None:  # (sequences packed together: within the shapes captured here)
            prefixed.limit_packing(self.max_pages * PAGE_SIZE)
        if whole and chunks and prefixed.capture:
            note = (
                f"capturing the prefill's CUDA graphs for {len(chunks)} shapes of chunks after a cached prefix "
                f"(up to {max(m for _, m in chunks)} tokens after up to {max(start for start, _ in chunks)})"
            )
            for i, (start, m) in enumerate(chunks):
                passes.append((None if i else note, call([PrefillRequest([0] * m, start, aliased)])))
        if whole:
            passes.append((None, call([PrefillRequest([0] * n, 0, chunk_table)], True)))
            longest = self.max_pages * PAGE_SIZE - n  # (the most keys a usual-path chunk gathers)
            if longest > 0:
                passes.append((None, _peak_only(call([PrefillRequest([0] * n, longest, aliased)], True))))
        return passes

    def _warm_up_plain(self) -> None:
        """On a GPU, one whole chunk of the model's plain forward after the longest prefix the
        context allows: its peak is what the memory plan (mk.engine.memory) must leave room for."""
        n, pages = self._whole_chunk()
        if self.model.device.type != "cuda" or self.kv.num_blocks < self.layers * pages:
            return
        start = self.max_pages * PAGE_SIZE - n
        tokens = torch.zeros(n, dtype=torch.long)
        _peak_only(lambda: self.model.forward(tokens, start, self.kv, self._scratch_table(pages), last_only=True))()

    def _whole_chunk(self) -> tuple[int, int]:
        return _whole_chunk(self.prefill_chunk, self.max_pages)

    def _scratch_table(self, pages: int) -> torch.Tensor:
        """[layers, max_pages]: every page of the context mapped to one of the first `pages` x layers
        scratch blocks (its layer's): a chunk anywhere in the context writes and reads only those."""
        chunk_table = torch.arange(self.layers * pages, dtype=torch.int32).view(self.layers, pages)
        return chunk_table[:, torch.arange(self.max_pages) % pages]

    def release(self) -> None:
        """Drop the KV pool, a sliced prefill's state and the prefill's CUDA graphs, once the GPU has
        finished with them (the engine has stopped): their memory goes back to PyTorch's cache."""
        if self.model.device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # (a sticky CUDA error: drop them all the same)
                torch.cuda.synchronize(self.model.device)
        self.release_graphs()
        self.sliced = None
        self.kv = None

    def release_graphs(self) -> None:
        """Drop the packed prefill's CUDA graphs and their memory."""
        if self.packed_prefill is None:
            return
        for passes in (self.packed_prefill.fresh, self.packed_prefill.prefixed):
            if passes is not None:
                passes.release()
        self.packed_prefill.renew_graph_pool()  # (the next captures' pool starts empty)

    def _sync(self, dirty: list[tuple[int, bytes]]) -> None:
        for row, data in dirty:
            self.tables[row] = torch.frombuffer(bytearray(data), dtype=torch.int32).view(self.layers, self.max_pages)

    def prefill(
        self,
        pieces: list[tuple[int, list[int], int, bool]],
        dirty: list[tuple[int, bytes]],
        layers: tuple[int, int] | None = None,
    ):
        """Prefill chunks `(row, tokens, start, last)` of distinct sequences; returns the logits of the
        pieces with `last` set, [count, vocab], in order. `layers` (start, end): one slice of a
        layer-sliced call (rust/engine/core.rs), the same pieces in every slice from layer 0 on;
        logits only from the slice that ends at the last layer, [0, vocab] before it."""
        self._sync(dirty)
        with _threads_for(self.model, sum(len(tokens) for _, tokens, _, _ in pieces)):
            return self._prefill(pieces, layers)

    def _prefill(self, pieces: list[tuple[int, list[int], int, bool]], layers: tuple[int, int] | None):
        last = [i for i, (_, _, _, is_last) in enumerate(pieces) if is_last]
        if layers is not None:
            return self._prefill_slice(pieces, last, *layers)
        self.sliced = None  # (a sliced call the engine dropped: its state goes)
        if self.packed_prefill is not None:
            # One packed forward pass. Rust mapped every page of every chunk before calling (the
            # page contract of mk.prefill.packed).
            requests = [PrefillRequest(tokens, start, self.tables[row]) for row, tokens, start, _ in pieces]
            logits = self.packed_prefill(requests, self.kv).logits[last]
        else:
            rows = []
            for row, tokens, start, is_last in pieces:
                out = self.model.forward(torch.tensor(tokens), start, self.kv, self.tables[row], last_only=True)
                if is_last:
                    rows.append(out[-1])
            logits = torch.stack(rows) if rows else torch.empty(0, self.model.config.vocab_size)
        return _host(logits)

    def _prefill_slice(self, pieces, last: list[int], start: int, end: int):
        if self.packed_prefill is None:
            raise ValueError("a layer-sliced prefill needs the packed prefill (mk.prefill.packed)")
        if start == 0:
            self.sliced = None  # (a call dropped half way is forgotten)
            requests = [PrefillRequest(tokens, first, self.tables[row]) for row, tokens, first, _ in pieces]
            self.sliced = self.packed_prefill.sliced(requests, self.kv)
        if self.sliced is None:
            raise ValueError(f"prefill slice {start}..{end} of a call that did not start at layer 0")
        sliced = self.sliced
        try:
            sliced.run(start, end)
        except BaseException:
            self.sliced = None
            raise
        if end < self.layers:
            return np.zeros((0, self.model.config.vocab_size), dtype=np.float32)
        self.sliced = None
        return _host(sliced.logits()[last])


class PytorchRunner(PrefillRunner):
    """Decodes with the PyTorch model too (its own decode and verify)."""

    def decode(self, rows: list[int], tokens: list[int], positions: list[int], dirty: list[tuple[int, bytes]]):
        """Logits [len(rows), vocab] of one decode step. A row may repeat: a sequence's verification
        rows (speculative decoding), consecutive entries at consecutive positions."""
        self._sync(dirty)
        with _threads_for(self.model, len(rows)):
            if len(set(rows)) == len(rows):
                tables = [self.tables[r] for r in rows]
                logits = self.model.decode(torch.tensor(tokens), torch.tensor(positions), self.kv, tables)
            else:
                logits = self.model.verify(self._verification(rows, tokens, positions), self.kv)
        return _host(logits)

    def _verification(
        self, rows: list[int], tokens: list[int], positions: list[int]
    ) -> list[tuple[list[int], int, torch.Tensor]]:
        """`Model.verify`'s sequences: runs of equal rows, each at consecutive positions from its first."""
        if not len(rows) == len(tokens) == len(positions):
            raise ValueError(f"decode got {len(rows)} rows, {len(tokens)} tokens and {len(positions)} positions")
        groups: list[tuple[list[int], int, torch.Tensor]] = []
        seen: set[int] = set()
        for i, (row, token, position) in enumerate(zip(rows, tokens, positions, strict=True)):
            if i and row == rows[i - 1]:
                group_tokens, first, _ = groups[-1]
                if position != first + len(group_tokens):
                    raise ValueError(f"row {row}'s verification rows are not at consecutive positions")
                group_tokens.append(token)
                continue
            if row in seen:
                raise ValueError(f"row {row} appears apart from its other rows in one decode step")
            seen.add(row)
            groups.append(([token], position, self.tables[row]))
        return groups


@contextlib.contextmanager
def _threads_for(model: Model, tokens: int):
    """One intra-op thread for the duration on the CPU when `tokens` < SERIAL_TOKENS, else as set.
    (Other threads keep their count; one that first uses PyTorch meanwhile starts with one. Each
    change also clears oneDNN's primitive cache, a cost the figures above include.)"""
    if model.device.type != "cpu" or tokens >= SERIAL_TOKENS:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _whole_chunk(chunk: int, max_pages: int) -> tuple[int, int]:
    """The tokens of one whole prefill chunk (at most the context's pages) and their pages."""
    n = min(chunk, max_pages * PAGE_SIZE)
    return n, -(-n // PAGE_SIZE)


def _peak_only(run: Callable[[], object]) -> Callable[[], None]:
    """A warm-up pass that is there for its memory peak alone: running out of memory is the plan's
    to report, any other failure a warning (the engine serves without it)."""

    def guarded() -> None:
        try:
            run()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:
            log.warning(
                "a warm-up pass for the memory plan failed (%s: %s); the plan may be short", type(e).__name__, e
            )

    return guarded


@contextlib.contextmanager
def _usual_path(prefill: Prefill):
    """`prefill` without its static passes (mk.prefill.static) for the duration."""
    fresh, prefixed, prefill.fresh, prefill.prefixed = prefill.fresh, prefill.prefixed, None, None
    try:
        yield
    finally:
        prefill.fresh, prefill.prefixed = fresh, prefixed


def _host(logits: torch.Tensor) -> np.ndarray:
    return logits.detach().to("cpu", torch.float32).contiguous().numpy()
