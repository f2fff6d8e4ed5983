"""A server whose "model" writes what the test asks for, to drive tool-call paths end to end.

The engine decodes the prompt; if the last user turn reads `SCRIPT:<text>`, it generates the tokens of
<text> (special tokens included) and then EOS; otherwise a short fixed answer. Run it as
`python -m tests.scripted_engine --port N [--api-key KEY]`.
"""

from __future__ import annotations

import argparse
import asyncio

from mk.config import ModelConfig
from mk.engine.api import EngineStats
from mk.engine.outputs import TokenEvent
from mk.engine.sampling import SamplingParams
from mk.server import App, ServerState, run
from mk.text.tokenizer import Tokenizer

USER, END = "<|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"


class _Stream:
    def __init__(self, tokens: list[int], params: SamplingParams, eos: int) -> None:
        self.request_id = "scripted"
        self.prompt_token_ids: list[int] = []
        self._tokens, self._params, self._eos = tokens + [eos], params, eos
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    async def __aiter__(self):
        for n, token in enumerate(self._tokens, 1):
            await asyncio.sleep(0.002)
            if self._cancelled:
                yield TokenEvent(None, finish_reason="cancelled")
                return
            reason = "stop" if token == self._eos else ("length" if n >= self._params.max_tokens else None)
            yield TokenEvent(token, finish_reason=reason)
            if reason:
                return


class ScriptedEngine:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.config = ModelConfig.tiny()
        self.max_context, self.max_batch = 4096, 8
        self.tok = tokenizer

    def submit(self, prompt_token_ids, params, request_id=None):
        text = self.tok.decode(prompt_token_ids)
        user = text.rsplit(USER, 1)[-1].split(END, 1)[0]
        script = user.removeprefix("SCRIPT:") if user.startswith("SCRIPT:") else "ok<|END_THINKING|>"
        ids = self.tok.encode(script, add_special_tokens=False)
        return _Stream(ids, params, self.config.eos_token_id)

    def prepare_constraint(self, spec) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=1)

    async def drain(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key")
    args = p.parse_args()
    tok = Tokenizer.builtin(ModelConfig.tiny().vocab_size)
    state = ServerState(ScriptedEngine(tok), tok, "scripted", api_key=args.api_key)
    run(App(state), "127.0.0.1", args.port, drain_timeout=5)


if __name__ == "__main__":
    main()
