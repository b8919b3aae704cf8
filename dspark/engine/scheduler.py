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
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.config import EngineConfig
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # query tokens this step: positions [num_computed, num_computed + num_tokens)
    num_spec_tokens: int  # drafts among them (the last num_spec_tokens rows)
    # a DSpark block launched on top of the step in flight (Scheduler.schedule_on_top): its rows follow
    # that step's outcome, which the host has not read (positions, anchor and drafts placed on the device)
    on_top: bool = False

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so logits are needed."""
        r = self.request  # (num_tokens_with_spec written out: this is read several times per request per step)
        return self.on_top or r.num_computed_tokens + self.num_tokens >= len(r.token_ids) + len(r.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # finished by the scheduler (e.g. KV exhausted)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class _GraphRows:
    """The prefill rows a graph step has left beside ``used`` decode rows: ``rows`` in all, q tokens each."""

    def __init__(self, q: int, rows: int, used: int) -> None:
        self.q, self.left = q, rows - used

    def take(self, num_new: int) -> int:
        """A prefill chunk of at most ``num_new`` tokens cut to the rows left, which it then uses."""
        num_new = min(num_new, max(0, self.left) * self.q)
        self.left -= -(-num_new // self.q)
        return num_new


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
        # (q, rows) with DSpark's prefill-row graphs (cuda_graphs.py; set by the engine): while requests
        # decode, a step's prefill chunks are cut to fit the graph's rows besides theirs (see schedule)
        self.graph_rows: tuple[int, int] | None = None
        # EngineConfig.graph_prefill_alone (set by the engine): whether a request's prefill chunk can run as
        # prefill rows of a graph step (ModelRunner.prefill_on_graphs); None: off
        self.prefill_on_graphs: Callable[[Request], bool] | None = None

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
        # Prefill-row graphs (``graph_rows``): while some requests decode, prefill chunks take at most the
        # graph rows the decoders leave, q tokens per row, the rest of a prompt going to the next steps
        # (chunked prefill, as vLLM's long_prefill_token_threshold caps a chunk beside running requests).
        # A longer chunk would run eagerly beside the decoders' graph step (ModelRunner._split): hundreds
        # of launches from Python, ~23 ms per admission at B=32 on the H200 (session 17) against ~4 ms for
        # each graph step. Without decoders (a first wave of prompts) the whole budget is one eager step,
        # unless ``prefill_on_graphs`` (EngineConfig.graph_prefill_alone): then the step's first chunk decides
        # whether it is a graph step (its chunks cut to the rows) or an eager one (uncut), and a chunk of
        # the other kind waits for the next step (an eager chunk would make the cut ones eager too).
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        alone = not decoding and self.prefill_on_graphs is not None
        rows = _GraphRows(*self.graph_rows, decoding) if self.graph_rows is not None and (decoding or alone) else None
        kind: list[bool] = []  # alone: whether this step's chunks go to the graphs (its first chunk's)

        def cap(req: Request, num_new: int) -> int:
            if rows is None or req.num_tokens - req.num_computed_tokens == 1:
                return num_new
            if alone:
                on = self.prefill_on_graphs(req)
                if not kind:
                    kind.append(on)
                if on != kind[0]:
                    return 0  # the other kind of chunk: next step
                if not on:
                    return num_new
            return rows.take(num_new)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            num_new = cap(req, min(num_new, max_len - req.num_computed_tokens))
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
            self._admit(out, budget, cap)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, cap, min_chunk: int = 1) -> None:
        """Admit waiting requests in arrival order while ``budget`` tokens, a seat and KV blocks last:
        each gets a prefill chunk (after its prefix-cache hits, fewer of them if the rest of its prompt
        would be shorter than ``min_chunk``) of at most ``cap(req, n)`` tokens."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_blocks: list[int] = []
            if req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.find_cached_prefix(req)
                while hit_blocks and req.num_tokens - num_hit < min_chunk:
                    hit_blocks.pop()
                    num_hit -= self.kv.block_size
                req.num_computed_tokens = num_hit
                if req.status is RequestStatus.WAITING:
                    req.stats.num_cached_tokens = num_hit
            num_new = cap(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new <= 0 or not self.kv.allocate_slots(req, num_new, hit_blocks, self.num_lookahead_tokens):
                req.num_computed_tokens = 0
                return
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, 0))
            budget -= num_new

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
            reason = self._append_checked(req, toks)
            if reason is not None:
                self.finish(req, *reason)
                finished.append(req)
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

    def schedule_on_top(self, out: SchedulerOutput, q: int,
                        admissible: Callable[[Request, int], bool] = lambda req, n: True) -> SchedulerOutput | None:
        """The DSpark step to launch on top of ``out``, a one-sync step in flight whose tokens are not
        applied yet (ModelRunner.launch_one_sync with ``prev``), or None when there is none to launch
        that way. Every request of ``out`` still running verifies a full block (q rows, q - 1 drafts,
        ``on_top``: its rows follow out's outcome on the device) — one that verified a block in ``out``,
        or one whose prompt ``out`` finished prefilling (its first token and drafts come from ``out``)
        — in the same order; requests that ended since ``out`` was launched (read back meanwhile) are
        left out; then waiting requests are admitted as prefill chunks into the graph rows and token
        budget left (as schedule() admits them: arrival order, prefix-cache hits, a chunk capped by the
        rows; ``admissible(req, chunk)``: whether the runner can launch a request's chunk so, the queue
        stops at one it cannot). None (the engine then reads ``out`` back first and schedules synchronously) when: a
        running request is not in ``out`` or is mid-prompt, one near max_model_len (3q tokens of margin;
        with logprobs or penalties also near max_tokens: such requests get only the drafts they can
        use), or KV blocks for the worst case (every draft of ``out`` accepted: 2q tokens past a block's
        start, a prompt's end + q) would need a preemption, or the next waiting request could have a seat
        but not be admitted on top (no prefill rows, not ``admissible``). KV for that worst case is allocated here;
        the engine gives back what the real outcome does not use (KVCacheManager.truncate)."""
        cont = [s for s in out.scheduled if not s.request.is_finished]
        if not cont or [s.request for s in cont] != self.running:
            return None
        ends = []
        need = 0
        for s in cont:
            req = s.request
            if req.num_pending:
                return None
            if s.num_tokens == q and s.num_spec_tokens == q - 1:  # verifying a block: the next starts <= q later
                end = req.num_computed_tokens + 2 * q
            elif not s.num_spec_tokens and req.num_computed_tokens + s.num_tokens == req.num_tokens:
                end = req.num_tokens + q  # the prompt's last chunk: its first token starts the next block
            else:
                return None
            # num_output_tokens written out (no pending tokens here)
            near_max_tokens = len(req.token_ids) - len(req.prompt_token_ids) + 3 * q >= req.params.max_tokens
            if (near_max_tokens and not req.params.device_verifiable) or end + q >= self.config.max_model_len:
                return None
            need += max(0, self.kv.blocks_needed(end) - len(self.kv.block_ids(req.request_id)))
            ends.append(end)
        budget = self.config.max_num_batched_tokens - len(cont) * q
        if budget < 0 or need > self.kv.num_free_blocks:
            return None
        if self._may_admit(len(cont) * q) and (self.graph_rows is None or not admissible(
                self.waiting[0], min(2, self.waiting[0].num_tokens))):  # its chunk is >= 2 tokens if it can be
            return None  # no prefill rows to admit it into: read back first, admit it synchronously
        for s, end in zip(cont, ends):
            ok = self.kv.allocate_slots(s.request, end - s.request.num_computed_tokens)
            assert ok, "KV checked above"
        nxt = SchedulerOutput([ScheduledRequest(s.request, q, q - 1, on_top=True) for s in cont])
        if self.graph_rows is not None:
            rows = _GraphRows(*self.graph_rows, len(cont))
            # a chunk of one token is a decode row; where that is not admissible (a sampled request), a
            # prefix hit up to the prompt's last token gives back its last block (chunk >= 2)
            self._admit(nxt, budget, lambda req, n: rows.take(n) if admissible(req, n) else 0,
                        min_chunk=2)
        return nxt

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

    def _append_checked(self, req: Request, toks: list[int]) -> tuple[str, int | None] | None:
        """Append a step's emitted tokens to ``req`` up to the first that ends it (``_check_stop`` for each
        token, with the length limits worked out once: this runs for every request at every step)."""
        p = req.params
        eos, stop_ids, ids = req.eos_token_ids, p.stop_token_ids, req.token_ids
        n_real = len(ids) - req.num_pending  # num_real_tokens (and num_output_tokens below), written out
        left = min(p.max_tokens - (n_real - len(req.prompt_token_ids)), self.config.max_model_len - n_real)
        for i, t in enumerate(toks, 1):
            ids.append(t)
            if t in eos or t in stop_ids:
                return "stop", t
            if i >= left:
                return "length", None
        return None

    def _check_stop(self, req: Request, token: int) -> tuple[str, int | None] | None:
        p = req.params
        if token in req.eos_token_ids:
            return "stop", token
        if token in p.stop_token_ids:
            return "stop", token
        if req.num_output_tokens >= p.max_tokens or req.num_real_tokens >= self.config.max_model_len:
            return "length", None
        return None
