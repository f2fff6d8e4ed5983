"""Typed stubs of mk's Rust extension (`rust/python/`). Keep in step with the #[pyfunction]s."""

from typing import Any, Protocol, final

from mk.config import ModelConfig
from mk.engine.options import EngineOptions

# ---- GPU kernels (rust/python/mod.rs) ----------------------------------------------------------

STEP_MAX_K: int  # MK_STEP_MAX_K: the longest GEMV reduction the megakernel takes
GEMV_MAX_GROUPS: int  # MK_GEMV_MAX_GROUPS: 16-row weight groups per GEMV task at most
STEP_HEAD_DIM: int  # MK_STEP_HEAD_DIM: the attention's head size
STEP_MAX_GROUP: int  # MK_STEP_MAX_GROUP: query heads per KV head at most
STEP_MAX_TOP_K: int  # MK_STEP_MAX_TOP_K: experts per token at most
STEP_MAX_EXPERTS: int  # MK_STEP_MAX_EXPERTS: experts per layer at most
ROW_GROUPS: int  # the task builder's default row groups of expert down and LM-head tasks
SAMPLE_PARTS: int  # the task builder's default vocabulary slices per row for sampling
JSON_LAYOUT: str  # llguidance's x-guidance options constrained JSON gets unless its schema has its own
STEP_MAX_ROWS: int  # MK_STEP_MAX_ROWS: rows per megakernel launch
MAX_DRAFT: int  # the most draft tokens one sequence verifies in a step
TENSOR_MAP_BYTES: int  # MK_TENSOR_MAP_BYTES: one encoded weight map
TRACE_ENTRY_BYTES: int  # sizeof(MkTraceEntry): one traced task
TRACE_MARKED: int  # MK_TRACE_MARKED: an entry's second producer word flags its marks
LEDGER_STAGES: int  # MK_LEDGER_STAGES: ring stages per block a -DMK_STREAM_LEDGER=1 kernel records
ROW_SAMPLE_BYTES: int  # sizeof(MkRowSample): how one row's token is drawn
LAYER_WEIGHT_COUNT: int  # MK_LW_COUNT: entries per layer of the weight tables
PER_STEP_FIELDS: list[str]  # MkStepArgs fields Rust fills in for every launch
LAYER_WEIGHTS: list[str]  # MkLayerWeight names in table order (NORM, Q, K, V, O, ROUTER, GATE, UP, DOWN)
TASK_OPS: dict[str, int]  # MkOp values by name (NOP, EMBED, GEMV, ...)
TASK_MATRICES: dict[str, int]  # MkMatrix values by name (QKV, O_PROJ, ...)
TASK_WORDS: int  # int32 words of one MkTask
TASK_ARG_WORD: int  # the word of MkTask.arg[0]
COUNTERS_PER_LAYER: int  # MK_COUNTERS_PER_LAYER
PAGE_SIZE: int  # MK_PAGE_SIZE: tokens per KV page

class GpuError(RuntimeError):
    """The GPU path failed or is unavailable."""

def gpu_available() -> bool: ...
def build_info() -> dict[str, Any]:
    """nvcc, gencode, defines (the build variant's nvcc -D flags), cubins {name: bytes}, abi_version."""

def weight_maps(matrices: list[tuple[int, int, int]]) -> bytes: ...
def kv_maps(k: int, v: int, rows: int, cols: int) -> bytes: ...
def gumbel_draw(logits: bytes, inv_temperature: float, seed: int, index: int) -> int:
    """The token the host sampler draws for a row with a temperature alone (fp32 logits as bytes)."""

def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether a request with this temperature and top-k (0 or less: off) draws greedily."""

# ---- decode-step task graph (rust/python/graph.rs) ---------------------------------------------

def build_step_graph(
    config: ModelConfig,
    positions: list[int],
    num_sms: int = 132,
    attn_chunk: int = 0,
    row_groups: int | None = None,
    sample_parts: int = ...,
    check: bool = False,
    dealing: str = "round_robin",
    qkv_groups: int | None = None,
    gate_up_groups: int | None = None,
    attention_first: bool | None = None,
    expert_queue: bool | None = None,
    local_routing: bool | None = None,
) -> dict[str, Any]:
    """tasks, order (bytes of int32 [.., 16]), num_sms, per_sm, num_counters, slots, max_splits,
    modelled_ns."""

def graph_dims_error(config: ModelConfig) -> str | None:
    """Why the config's shapes cannot be cut into the megakernel's tasks (rust/graph), or None."""

def step_args_layout() -> tuple[list[tuple[str, int, str]], int]: ...
def decode_step(device: int, stream: int, args: bytes, grid: int, kernel: int = 0) -> None: ...
def megakernel_count(device: int) -> int:
    """Megakernel variants loaded on the device: 1, or the variants $MK_MEGAKERNEL_CUBIN lists."""

# ---- the engine (rust/python/engine.rs) --------------------------------------------------------

class ConstraintError(ValueError):
    """A request's constraint cannot be compiled or followed."""

class PromptTooLongError(ValueError):
    """A prompt and its max_tokens do not fit the context: args (message, prompt tokens, max_tokens,
    context limit)."""

class QueueFullError(RuntimeError):
    """The engine's waiting queue is full."""

class EngineStoppedError(RuntimeError):
    """The engine is shut down."""

class PrefillRunner(Protocol):
    """What both backends call to prefill (mk.engine.runner.PrefillRunner). `dirty` lists the batch rows
    whose page-table entries changed: (row, bytes of int32 [layer][page])."""

    def prefill(
        self,
        pieces: list[tuple[int, list[int], int, bool]],
        dirty: list[tuple[int, bytes]],
        layers: tuple[int, int] | None = None,
    ) -> Any:
        """Chunks (row, tokens, start, last) of distinct sequences in one call; a float32 buffer
        [pieces with `last`, vocab] of their logits, in order. `layers` (start, end): one slice of a
        layer-sliced call, logits only from the one that ends at the last layer ([0, vocab] before)."""

class Runner(PrefillRunner, Protocol):
    """What the PyTorch backend calls (mk.engine.runner.PytorchRunner): prefill, and decode."""

    def decode(self, rows: list[int], tokens: list[int], positions: list[int], dirty: list[tuple[int, bytes]]) -> Any:
        """float32 buffer [len(rows), vocab]."""

class MegakernelRunner(PrefillRunner, Protocol):
    """What the Megakernel backend calls (mk.megakernel.runner.MegakernelRunner): `prefill`, and
    once at construction `megakernel_setup()`, read by attribute (a MegakernelSetup); `model.config`
    gives the geometry."""

    def megakernel_setup(self) -> Any: ...

@final
class Event:
    """One event of request `id`: a token (its logprob and top alternatives where asked), or the end
    (finish reason, error); the first token also carries the prompt tokens the prefix cache gave
    and the seconds the request waited for admission."""

    @property
    def id(self) -> int: ...
    @property
    def token(self) -> int | None: ...
    @property
    def logprob(self) -> float | None: ...
    @property
    def top(self) -> list[tuple[int, float]] | None: ...
    @property
    def finish(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def queue_seconds(self) -> float | None: ...

def kv_blocks_needed(sliding: list[bool], window: int, len: int, chunk: int) -> tuple[int, int]:
    """(blocks a len-token sequence holds decoding, peak blocks prefilling it in chunks), 64-token pages."""

def kv_keep_from(window: int, query: int) -> int:
    """First page a sliding layer still needs when the earliest query to come is at `query`."""

def kv_pool_blocks(budget: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """KV blocks (a page of K and V for every KV head) that fit in `budget` bytes."""

@final
class Engine:
    """The decode-loop thread over `runner` (None: a no-op backend that samples `noop_token`).
    `options`: a resolved mk.engine.options.EngineOptions (read by attribute; its `backend` is
    "pytorch", where the runner prefills and decodes, or "megakernel", where the runner, a
    MegakernelRunner, prefills and the megakernel decodes). `step_rows`: one decode step's rows."""

    def __new__(
        cls,
        runner: Runner | None,
        options: EngineOptions,
        *,
        sliding: list[bool],
        window: int,
        num_blocks: int,
        vocab_size: int,
        eos_token_id: int | None = None,
        noop_token: int = 1,
        step_rows: int = ...,
    ) -> Engine: ...
    def submit(
        self,
        id: int,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: list[int] = ...,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        constraint: tuple[str, str] | None = None,
    ) -> None:
        """Raises ValueError (bad request; PromptTooLongError past the context, ConstraintError for a
        constraint), QueueFullError, EngineStoppedError."""

    def check_constraint(self, kind: str, value: str) -> None:
        """Compiles (kind, text) as submit would; raises ConstraintError if it cannot be followed."""

    def compile_constraint(self, kind: str, value: str) -> None:
        """Compiles (kind, text) and keeps it for a submit that follows (the GIL released meanwhile);
        raises ConstraintError if it cannot be followed."""

    def hold(self) -> None:
        """Keeps later submissions from the scheduler until `release` (holds nest)."""

    def release(self) -> None:
        """Ends one `hold`; after the last, the held submissions reach the scheduler together."""

    def cancel(self, id: int) -> None: ...
    def cancel_all(self) -> None: ...
    def next_events(self, timeout: float) -> list[Event] | None:
        """Waits with the GIL released; [] on timeout, None once stopped and drained."""

    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    @property
    def is_running(self) -> bool: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def prefill_chunk(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...

@final
class Speculator:
    """One sequence's drafting for speculative decoding: drafts copied from its own text, their
    length adapted to how many were accepted."""

    def __new__(cls, prompt: list[int]) -> Speculator: ...
    def draft(self, most: int) -> list[int]:
        """The next step's draft, at most `most` tokens."""

    def advance(self, drafted: int, gained: list[int]) -> None:
        """After a step that verified `drafted` draft tokens and gained `gained` (1 to drafted + 1)."""
