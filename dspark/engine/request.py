"""One request's state as it moves through the engine.

Token bookkeeping (positions are absolute, 0-based):

    [0, num_computed_tokens)        KV written and committed (part of the real sequence)
    [num_computed_tokens, len(token_ids))   known tokens whose KV is not yet written
                                            (the rest of the prompt, or the last sampled token)
    token_ids + spec_token_ids      what a step may schedule: drafts ride after the real tokens

Only committed KV is ever hashed into the prefix cache, so positions written for drafts that were
later rejected can be rolled back by lowering num_computed_tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dspark.sampling_params import SamplingParams


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
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.stats = RequestStats()
        # Filled by the engine's detokenizer.
        self.output_text = ""
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
