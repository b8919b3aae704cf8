"""One request's state as it moves through the engine.

Token bookkeeping (positions are absolute, 0-based):

    [0, num_computed_tokens)        KV written and committed (part of the real sequence)
    [num_computed_tokens, len(token_ids))   known tokens whose KV is not yet written
                                            (the rest of the prompt, or the last sampled token)
    token_ids + spec_token_ids      what a step may schedule: drafts ride after the real tokens

With async scheduling (engine/llm_engine.py) the last ``num_pending`` entries of token_ids are
placeholders (PENDING_TOKEN): tokens of steps already launched on the GPU whose values the host has
not read back yet. They count in ``num_tokens`` (so the next step is scheduled at the right position)
but not in the output views (``output_token_ids``, ``num_output_tokens``, ``num_real_tokens``).

Only committed KV is ever hashed into the prefix cache, so positions written for drafts that were
later rejected can be rolled back by lowering num_computed_tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dspark.sampling_params import SamplingParams


PENDING_TOKEN = -1  # a placeholder in Request.token_ids for a token still on the GPU


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestStats:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0

    def as_dict(self, num_prompt_tokens: int, num_output_tokens: int) -> dict[str, float | int | None]:
        end = self.finish_time or time.perf_counter()
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        decode_time = None if self.first_token_time is None else end - self.first_token_time
        tps = None
        if decode_time and num_output_tokens > 1:
            tps = (num_output_tokens - 1) / decode_time
        return {
            "num_prompt_tokens": num_prompt_tokens,
            "num_output_tokens": num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "time_to_first_token_s": ttft,
            "e2e_latency_s": end - self.arrival_time,
            "decode_tokens_per_s": tps,
        }


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: tuple[int, ...],
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # resolved per-request seed: params.seed or one drawn by the engine
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing placeholders in token_ids (async scheduling, see the module docstring)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.stats = RequestStats()
        # Filled by the engine's detokenizer.
        self.output_text = ""
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.plain_graph_row: bool | None = None  # ModelRunner._plain_graph_row's answer, once asked

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known and pending tokens: the next step computes position num_tokens - 1 onwards."""
        return len(self.token_ids)

    @property
    def num_real_tokens(self) -> int:
        """Tokens whose values the host knows (num_tokens without the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return self.num_real_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):self.num_real_tokens]

    # ---------------------------------------------------------------- async scheduling
    def append_pending(self) -> None:
        """A step that will emit one token for this request was launched: hold its place."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token was read back: put its value in its place."""
        assert self.num_pending > 0, "no pending token to resolve"
        self.token_ids[len(self.token_ids) - self.num_pending] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget the pending placeholders (the request ended; their steps' results are discarded)."""
        if self.num_pending:
            del self.token_ids[len(self.token_ids) - self.num_pending:]
            self.num_pending = 0

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        self._status = value
        # an attribute, not a property: read several times per request per step
        self.is_finished = value is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
