"""Decides which requests run in the next step and how many tokens each gets.

Phase-less (as in vLLM v1): a request has ``num_computed_tokens``; a step gives it
``num_tokens_with_spec - num_computed_tokens`` more, capped by the step's token budget. A long prompt
is thus prefilled in chunks, a decoding request gets 1 token (or 1 + its drafts), and prefill and
decode share one batch. Running requests are served first (in arrival order); waiting ones are
admitted while budget, ``max_num_seqs`` and KV blocks allow. When a running request cannot get KV
blocks, the most recently admitted running request is preempted: its blocks are freed and it is
recomputed later from its tokens (the prefix cache usually makes that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dspark.config import EngineConfig
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # query tokens this step: positions [num_computed, num_computed + num_tokens)
    num_spec_tokens: int  # drafts among them (the last num_spec_tokens rows)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so logits are needed."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens >= r.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # finished by the scheduler (e.g. KV exhausted)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, num_lookahead_tokens: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.num_lookahead_tokens = num_lookahead_tokens  # KV slots reserved per request for drafts
        # requests running at once; config.max_num_seqs (what graphs and buffers are sized for) unless
        # lowered (dspark bench runs a cell at concurrency B on an engine built for the largest B)
        self.max_num_seqs = config.max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---------------------------------------------------------------- requests in and out
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stop, length, abort) and free its KV blocks at once."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.drop_pending()  # steps still in flight for it are discarded
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.spec_token_ids = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            num_new = min(num_new, max_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            if req.spec_token_ids and req.num_computed_tokens + num_new < req.num_tokens_with_spec:
                # Out of budget for all drafts: verify fewer rather than split a verification.
                del req.spec_token_ids[max(0, req.num_computed_tokens + num_new - req.num_tokens):]
            if not self._make_room(req, num_new, out):
                continue  # req left the running list; running[i] is now the next request
            out.scheduled.append(ScheduledRequest(req, num_new, len(req.spec_token_ids)))
            budget -= num_new
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hit_blocks: list[int] = []
                if req.num_computed_tokens == 0:
                    hit_blocks, num_hit = self.kv.find_cached_prefix(req)
                    req.num_computed_tokens = num_hit
                    if req.status is RequestStatus.WAITING:
                        req.stats.num_cached_tokens = num_hit
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.allocate_slots(req, num_new, hit_blocks, self.num_lookahead_tokens):
                    req.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new, 0))
                budget -= num_new
        return out

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate KV for ``req``, preempting the newest running requests as needed. Returns False
        if ``req`` itself had to leave: preempted, or finished when it alone overflows the cache."""
        while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=self.num_lookahead_tokens):
            victim = self.running[-1]  # never one already scheduled this step: those sit before req
            if victim is req and len(self.running) == 1:
                self.finish(req, "length")  # nothing left to free: the cache cannot hold it
                out.finished.append(req)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[Request]:
        """Apply a step's results. ``new_tokens[id]`` holds the tokens emitted for a request that
        sampled: accepted drafts followed by one recovered or bonus token (just one token without
        speculation). Rejected drafts' positions are rolled back. Returns requests that finished on
        a token-level stop (EOS, stop token, max_tokens, max_model_len)."""
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_tokens
            toks = new_tokens.get(req.request_id)
            if toks is None:  # a prefill chunk that does not reach the end of the prompt
                self.kv.commit(req)
                continue
            num_accepted_drafts = len(toks) - 1
            num_rejected = s.num_spec_tokens - num_accepted_drafts
            assert num_rejected >= 0, "more tokens emitted than drafts verified + 1"
            req.num_computed_tokens -= num_rejected
            req.spec_token_ids = []
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.perf_counter()
            for t in toks:
                req.token_ids.append(t)
                reason = self._check_stop(req, t)
                if reason is not None:
                    self.finish(req, *reason)
                    finished.append(req)
                    break
            self.kv.commit(req)  # after appending: accepted drafts are committed tokens now
        return finished

    # ---------------------------------------------------------------- async scheduling
    def _may_admit(self, rows: int) -> bool:
        """Whether ``schedule()`` could admit a waiting request after the running ones took ``rows``
        tokens: someone waits, a seat is free and budget is left (its admission loop's conditions;
        whether the KV pool has room is not checked: refusing to continue then costs one bubble).
        Requests that cannot get a seat do not stop the overlap (a server under load)."""
        return (bool(self.waiting) and len(self.running) < self.max_num_seqs
                and rows < self.config.max_num_batched_tokens)

    def can_continue(self, out: SchedulerOutput) -> bool:
        """Whether the next ``schedule()`` gives every request of ``out`` (a decode step in flight, each
        request holding one pending placeholder) exactly one more decode row, in the same order, and
        nothing else: nobody can be admitted (``_may_admit``), none is known to end with the pending token
        (max_tokens, max_model_len; a stop token or string is only known later, and then the next
        step's row is discarded), and the KV pool has the blocks without preempting (requests waiting
        for a seat that schedule() could not give them do not matter). No side effects."""
        if self._may_admit(len(out.scheduled)) or len(self.running) != len(out.scheduled):
            return False
        if len(out.scheduled) > self.config.max_num_batched_tokens:
            return False
        need = 0
        for s, req in zip(out.scheduled, self.running):
            if s.request is not req or req.spec_token_ids:
                return False
            if (req.num_output_tokens + req.num_pending >= req.params.max_tokens
                    or req.num_tokens >= self.config.max_model_len):
                return False
            need += max(0, self.kv.blocks_needed(req.num_computed_tokens + 1 + self.num_lookahead_tokens)
                        - len(self.kv.block_ids(req.request_id)))
        return need <= self.kv.num_free_blocks

    def can_continue_spec(self, out: SchedulerOutput, q: int) -> bool:
        """``can_continue`` for a DSpark verification step in flight (every request verifying q - 1
        drafts, its tokens not yet applied): whether the same requests can verify a full block again
        on top of it (ModelRunner.launch_one_sync with ``prev``): nobody to admit, the same running
        requests in order, everybody far enough from max_model_len (and a request with logprobs from
        max_tokens) that the step in flight and the next one leave it a full block of drafts (3q tokens
        of margin), and KV blocks for the worst case (``reserve_spec``) without preempting. No side
        effects."""
        if self._may_admit(len(out.scheduled) * q) or len(self.running) != len(out.scheduled):
            return False
        if len(out.scheduled) * q > self.config.max_num_batched_tokens:
            return False
        need = 0
        for s, req in zip(out.scheduled, self.running):
            if s.request is not req or s.num_tokens != q or req.num_pending:
                return False
            # a request verified on the device (no logprobs, no penalties) keeps full blocks to max_tokens
            # (ModelRunner._num_drafts); a token past it is dropped by update
            near_max_tokens = req.num_output_tokens + 3 * q >= req.params.max_tokens
            if ((near_max_tokens and not req.params.device_verifiable)
                    or req.num_tokens + 3 * q >= self.config.max_model_len):
                return False
            need += max(0, self.kv.blocks_needed(req.num_computed_tokens + 2 * q)
                        - len(self.kv.block_ids(req.request_id)))
        return need <= self.kv.num_free_blocks

    def reserve_spec(self, out: SchedulerOutput, q: int) -> SchedulerOutput:
        """After ``can_continue_spec``: KV blocks for the next block of every request at its latest
        possible start (num_computed + q: all drafts of the step in flight accepted), and the
        SchedulerOutput of that next step (q rows, q - 1 drafts each)."""
        for s in out.scheduled:
            ok = self.kv.allocate_slots(s.request, 2 * q)
            assert ok, "reserve_spec without can_continue_spec"
        return SchedulerOutput([ScheduledRequest(s.request, q, q - 1) for s in out.scheduled])

    def launched(self, out: SchedulerOutput) -> None:
        """A decode step was launched without waiting for the previous one's tokens: its rows count as
        computed and its tokens as pending placeholders until ``update_async`` puts their values in."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            s.request.append_pending()

    def update_async(self, out: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[Request]:
        """``update`` for a step that went through ``launched``: each request's oldest placeholder gets
        its value. Requests that ended meanwhile (a stop in an earlier step, an abort) are skipped.
        Returns the requests that got their token (some may have finished on it)."""
        applied: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            (tok,) = new_tokens[req.request_id]
            req.resolve_pending(tok)
            applied.append(req)
            if req.stats.first_token_time is None:
                req.stats.first_token_time = time.perf_counter()
            reason = self._check_stop(req, tok)
            if reason is not None:
                self.finish(req, *reason)
            else:
                self.kv.commit(req)
        return applied

    def _check_stop(self, req: Request, token: int) -> tuple[str, int | None] | None:
        p = req.params
        if token in req.eos_token_ids:
            return "stop", token
        if token in p.stop_token_ids:
            return "stop", token
        if req.num_output_tokens >= p.max_tokens or req.num_real_tokens >= self.config.max_model_len:
            return "length", None
        return None
