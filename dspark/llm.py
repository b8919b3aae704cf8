"""Offline API: ``LLM(model=...).generate(prompts, params)`` and ``LLM.chat(messages, params)``."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from dspark.engine.llm_engine import LLMEngine, RequestOutput
from dspark.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Runs a model to completion over a list of prompts with continuous batching.

    Keyword arguments go to the engine (``device``, ``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``num_kv_blocks``, ``kv_cache_memory_gb``,
    ``enable_prefix_caching``, ``seed``).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        plist = self._params_list(params, len(prompts))
        return self._run([(p, sp) for p, sp in zip(prompts, plist)], use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them; the model's chat template
        adds the assistant prompt."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plist = self._params_list(params, len(convs))
        ids = [self.engine.tokenize_chat(c) for c in convs]
        return self._run(list(zip(ids, plist)), use_tqdm)

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(self, items: list[tuple[Prompt, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt, sp in items:
                ids.append(self.engine.add_request(prompt, sp))
        except InvalidRequestError:
            for rid in ids:  # leave the engine as we found it
                self.engine.abort(rid)
            while self.engine.has_unfinished() or self.engine.requests:
                self.engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while len(results) < len(ids):
            for out in self.engine.step(final_only=True):
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]
