"""`mk.LLM`: the offline and embedding-friendly face of the engine, shaped like vLLM's.

    llm = mk.LLM()                       # the embedded default model
    outs = llm.generate(["def f(x):"], mk.SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)

Stop strings are handled here (they need text): the request is cancelled at the first match and
its text cut before the stop string, with finish reason "stop".

Text prompts are healed (mk.text.healing; `token_healing=False` turns it off): one that ends where a longer
token could start is submitted without its last token(s), and the completion is held to begin with
their text, which is then left out of `text` (the prompt has it). `prompt_token_ids` are the prompt's
own; `token_ids` and `logprobs` are every generated token's, the first one's text partly the prompt's,
and max_tokens counts them all.
"""

from __future__ import annotations

import queue
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from mk.engine.engine import Engine
from mk.engine.outputs import CompletionOutput, RequestOutput, TokenEvent
from mk.engine.sampling import SamplingParams
from mk.text.healing import HealedText, Healing, heal, strip_healed
from mk.text.textstream import Detokenizer, StopMatcher
from mk.text.tokenizer import Tokenizer

Prompt = str | list[int]


def default_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The model `mk.LLM()` serves when given none: the server's default (mk.default_model), with its
    mk.text.tokenizer.Tokenizer."""
    from mk.default_model import load_default

    return load_default(device, dtype)


class _Choice:
    """One completion being collected: tokens, logprobs, and stop strings matched on the text as it
    grows (the server's Detokenizer and StopMatcher: each token is decoded once)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int, healed: str = "") -> None:
        self.tokenizer, self.params, self.index = tokenizer, params, index
        self.healed = healed  # text the completion begins with that the prompt already holds (healing)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.text: str | None = None
        self.finish: str | None = None
        self.cached = 0
        self.stream = None
        self._detok = Detokenizer(tokenizer, keep_special=()) if params.stop else None
        self._stops = StopMatcher(list(params.stop)) if params.stop else None
        self._unhealed = HealedText(healed)  # (before the stop strings: none may match the prompt's text)
        self._so_far = ""

    def add(self, event: TokenEvent) -> bool:
        """Records `event`; True when this completion is over."""
        if self.finish is not None:
            return False  # the cancel after a stop-string match
        if event.cached_tokens is not None:
            self.cached = event.cached_tokens
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
                self.top.append(event.top_logprobs or ())
        if self._stops is not None:
            if event.token_id is not None:
                self._so_far += self._stops.push(self._unhealed.push(self._detok.push(event.token_id)))
            if event.finish_reason is not None:  # after a match both give ""
                self._so_far += self._stops.push(self._unhealed.push(self._detok.flush()))
                self._so_far += self._stops.flush()
            if self._stops.matched is not None:
                self.text, self.finish = self._so_far, "stop"
                if event.finish_reason is None and self.stream is not None:
                    self.stream.cancel()
                return True
        if event.finish_reason is not None:
            self.finish = event.finish_reason
            return True
        return False

    def output(self) -> CompletionOutput:
        if self.text is not None:
            text = self.text
        else:
            text = strip_healed(self.tokenizer.decode(self.token_ids, skip_special_tokens=True), self.healed)
        want = self.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish,
            logprobs=list(self.logprobs) if want else None,
            top_logprobs=list(self.top) if want else None,
        )


class LLM:
    """A model and an engine. `model`: a checkpoint folder (config.json, safetensors,
    tokenizer.json) or None for the embedded default. Engine options (max_batch, max_context,
    prefill_chunk, kv_blocks, gpu_memory_utilization, speculative, ...) pass through to
    `mk.engine.engine.Engine`.
    `token_healing`: heal text prompts (the module's docstring, mk.text.healing); it needs the engine's
    `tokenizer_json` (given by default), without which it is off."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_waiting: int = 1 << 20,
        token_healing: bool = True,
        **engine_options,
    ) -> None:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if model is None:
            self.model, self._text = default_model(device, dtype)
        else:
            from mk.model import load

            self.model = load(model, device=device, dtype=dtype)
            self._text = Tokenizer.from_dir(model)
        self.tokenizer = self._text.hf  # the HF `tokenizers.Tokenizer`, as before
        engine_options.setdefault("tokenizer_json", self._text.hf.to_str())  # for constrained requests
        # (healing is a grammar: the engine compiles it against the tokenizer's vocabulary)
        self.token_healing = token_healing and engine_options["tokenizer_json"] is not None
        self.engine = Engine(self.model, max_waiting=max_waiting, **engine_options)

    def encode(self, prompt: Prompt) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self._text.encode(prompt)

    def _heal(self, prompt: Prompt, ids: list[int], params: SamplingParams) -> Healing | None:
        """The healing of a text prompt where it applies (mk.text.healing.heal); token ids are taken as given."""
        if not self.token_healing or not isinstance(prompt, str):
            return None
        return heal(self._text, ids, params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt (text or token ids) to completion, batched by the engine; results in
        prompt order. `params`: one for all prompts or one per prompt (default: SamplingParams())."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        done: queue.SimpleQueue[int] = queue.SimpleQueue()
        results, pending = [], 0
        for prompt, p in zip(prompts, params, strict=True):
            ids = self.encode(prompt)
            healing = self._heal(prompt, ids, p)
            healed = healing.removed if healing else ""
            choices = [_Choice(self._text, _choice_params(p, j), j, healed) for j in range(p.n)]
            results.append((prompt, ids, choices, healing))
        # Submitted together, the batch runs the same way every time (Engine.together).
        with self.engine.together():
            try:
                for i, (_, ids, choices, healing) in enumerate(results):
                    for c in choices:
                        sent, sent_params = _submitted(ids, c.params, healing)
                        c.stream = self.engine.submit_callback(sent, sent_params, _collector(c, done, i))
                        pending += 1
            except BaseException:
                # A prompt that cannot be submitted ends the call: the ones before it never start.
                for _, _, choices, _ in results:
                    for c in choices:
                        if c.stream is not None:
                            c.stream.cancel()
                raise
        bar = _progress(len(prompts), use_tqdm)
        left = [len(r[2]) for r in results]
        while pending:
            i = done.get()
            pending -= 1
            left[i] -= 1
            if left[i] == 0 and bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [_request_output(str(n), prompt, ids, choices) for n, (prompt, ids, choices, _) in enumerate(results)]

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output so far after every token (text and ids cumulative); the
        last one carries the finish reason. Leaving the loop early cancels the request."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        healing = self._heal(prompt, ids, params)
        choice = _Choice(self._text, _choice_params(params, 0), 0, healing.removed if healing else "")
        choice.stream = stream = self.engine.submit(*_submitted(ids, choice.params, healing))
        async for event in stream:
            over = choice.add(event)
            yield _request_output(stream.request_id, prompt, ids, [choice])
            if over:
                stream.cancel()
                return

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _choice_params(p: SamplingParams, j: int) -> SamplingParams:
    """Choice j of an n-way request: its own stream, seeded seed + j when seeded."""
    if p.n == 1:
        return p
    from dataclasses import replace

    return replace(p, n=1, seed=None if p.seed is None else p.seed + j)


def _submitted(ids: list[int], params: SamplingParams, healing: Healing | None) -> tuple[list[int], SamplingParams]:
    """What the engine gets for a prompt: the healed prompt under its grammar, or the prompt as it is."""
    return (ids, params) if healing is None else (healing.prompt, healing.params(params))


def _collector(choice: _Choice, done: queue.SimpleQueue, i: int):
    def on_event(event: TokenEvent) -> None:
        if choice.add(event):
            done.put(i)

    return on_event


def _request_output(rid: str, prompt: Prompt, ids: list[int], choices: list[_Choice]) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=ids,
        outputs=[c.output() for c in choices],
        cached_tokens=choices[0].cached if choices else 0,
    )


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="prompt")
