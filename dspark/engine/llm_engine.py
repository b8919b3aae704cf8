"""LLMEngine: requests in, incremental outputs out. One ``step()`` = schedule -> run -> update.

    add_request ─► Scheduler.waiting ─► schedule() ─► ModelRunner.execute() ─► Scheduler.update()
                                                                              ─► detokenize, stop strings
                                                                              ─► RequestOutput deltas
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dspark.config import EngineConfig
from dspark.engine.detokenizer import IncrementalDetokenizer
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.engine.scheduler import Scheduler
from dspark.models.loader import load_model
from dspark.sampling_params import InvalidRequestError, SamplingParams
from dspark.spec.adaptive import AcceptanceEstimate, SampledBatchRule, VerifyLengthPolicy
from dspark.spec.config import SpeculativeConfig, SpeculativeConfigError, resolve_for_target
from dspark.spec.metrics import SpecStats
from dspark.spec.proposer import DSparkProposerFactory

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all output text so far
    token_ids: list[int]  # all output tokens so far
    delta_text: str  # text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict] | None = None


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(table)}")
    return table[dtype]


class LLMEngine:
    def __init__(self, model: str | None = None, *, device: str | None = None,
                 dtype: str | torch.dtype | None = None,
                 speculative_config: SpeculativeConfig | dict | str | None = None,
                 proposer_factory: Any = None, **engine_kwargs: Any) -> None:
        """``proposer_factory`` replaces the DSpark drafter named by ``speculative_config["model"]``
        with another proposer (see spec/proposer.py; tests use an oracle)."""
        spec = SpeculativeConfig.parse(speculative_config)  # key errors before any loading
        dev = resolve_device(device)
        cfg = EngineConfig(device=dev, dtype=resolve_dtype(dtype, dev), **engine_kwargs)
        loaded = load_model(model, cfg.dtype, dev)
        mc = loaded.config
        if cfg.max_model_len is None:
            cfg = replace(cfg, max_model_len=mc.max_position_embeddings)
        elif cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        self.config = cfg
        self.model_name = loaded.name
        self.model_config = mc
        self.tokenizer = loaded.tokenizer
        factory = proposer_factory
        # no drafter named: the one dspark ships for this target with its settings (not for a proposer given in code)
        spec = resolve_for_target(spec, loaded.name if factory is None else None)
        if spec is not None and factory is None:
            factory = DSparkProposerFactory(spec, mc, cfg.max_model_len + 64, cfg.dtype, dev)
        if factory is not None and spec is None:
            spec = SpeculativeConfig()
        if torch.device(dev).type == "cuda":  # count (and, once serving, log) Triton compiles: kernels/compile_watch.py
            from dspark.kernels import compile_watch
            compile_watch.install()
        self.runner = ModelRunner(loaded, cfg, spec, factory)
        del loaded
        self.spec_config = spec
        self.spec_notes = getattr(factory, "notes", [])
        self.spec_stats = SpecStats()  # aggregated over all requests
        self._req_spec: dict[str, SpecStats] = {}
        self.kv = KVCacheManager(self.runner.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.kv)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (chars, tokens) already reported
        self._seed_rng = random.Random(cfg.seed)
        self._aborted: list[Request] = []
        self._inflight = None  # (SchedulerOutput, runner.InflightStep): a launched step not yet read back
        self._final_only = False  # this step() reports finished requests only
        # DSpark with async scheduling: prompts admitted as prefill rows of a step launched on top of the
        # one in flight (Scheduler.schedule_on_top). False: an admission first reads the step in flight
        # back and runs synchronously (the path before session 20; benchmarks compare the two).
        self.admit_on_top = True
        self._counter = 0
        # Adaptive verification (spec/adaptive.py): which of the verify lengths the next steps use; needs
        # one set of CUDA graphs per length and their profiled step times (tests give a step_time)
        self.verify_policy: VerifyLengthPolicy | None = None
        self._next_length: int | None = None  # a change decided while a step was in flight
        self._last_readback = None  # (perf_counter, drafts verified) of the last pipelined read-back
        if self.runner.step_times is not None:
            self.enable_adaptive_verification(self.runner.step_time)
        elif len(self.runner.graph_sets) > 1 and spec.sampled_verify_length is not None:
            self.enable_sampled_batch_rule()
        elif len(self.runner.verify_lengths()) > 1:  # (the sampled-batch rule is the shipped drafter's default:
            # on a CPU that is no mistake of the user's, so it is only an info line there)
            key = "verify_lengths" if spec.verify_lengths is not None else "sampled_verify_length"
            logger.log(logging.WARNING if key == "verify_lengths" else logging.INFO,
                       "%s %s need CUDA graphs (the triton backend on CUDA, no --enforce-eager): every step "
                       "verifies %d drafts", key, getattr(spec, key), self.runner.num_spec_tokens)
        self.warmup_s: float | None = None
        if cfg.warmup or (cfg.warmup is None and torch.device(dev).type == "cuda"):
            self.warmup_s = self.warm_up()

    def warm_up(self, lengths: tuple[int, ...] = (5, 16, 37)) -> float:
        """Run throwaway requests before serving: prefills of several lengths (Triton specialises a
        kernel on its integer arguments' divisibility by 16, so lengths on and off multiples of 16), a
        prefill mixed into decode / verification steps, greedy and seeded sampled requests. CUDA graph
        capture covers decode and verification steps only; without this the first real requests paid
        for the eager paths' compiles (on a fresh H200, ~2 minutes of compilation spread over the first
        bench cells, session 13). Leaves no trace: the requests are gone, the statistics zero, the
        prefix cache empty, the request-id counter and the seed stream untouched. Returns the seconds."""
        if self.requests:
            raise RuntimeError("warm_up runs before any request")
        t0 = time.perf_counter()
        self.runner.precompile_verification()  # every draft count's verification kernels, not only those met below
        seed_state = self._seed_rng.getstate()  # requests without a seed draw theirs from this stream
        V, L = self.model_config.vocab_size, self.config.max_model_len
        budget = 8  # new tokens per request
        # and one prompt just past each context bucket's lower edge (cuda_graphs.context_buckets): eager
        # steps take their attention launch by bucket (layers/triton_attention.seq_len_hint), so the first
        # prompt of each bucket would otherwise compile its launch while served (kernels/compile_watch.py)
        from dspark.engine.cuda_graphs import context_buckets

        room = self.kv.num_usable_blocks * self.kv.block_size // 2
        edges = [b + 1 for b in context_buckets(L)[:-1] if b + 1 + budget < min(L, room)]
        lengths = tuple(lengths[:-1]) + tuple(edges) + tuple(lengths[-1:])
        prompts = [[(11 + 31 * j) % V for j in range(max(1, min(n, L - budget - 1)))] for n in lengths]
        params = [SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_tokens=budget, ignore_eos=True)]
        # With adaptive verification, once per verify length: the eager paths beside each length's graphs
        # (a prefill split off a verification step, ...) compile their own kernels, which a length first
        # used under load otherwise compiled there (H200, session 30: a 1.6 s stall inside a timed bench
        # cell, the whole of the "adaptive is slower" reading of sessions 29-30).
        policy, self.verify_policy = self.verify_policy, None
        for n in sorted(self.runner.graph_sets) if len(self.runner.graph_sets) > 1 else [None]:
            if n is not None:
                self.runner.use_verify_length(n)
            ids, tag = [], "" if n is None else f"{n}-"
            for i, p in enumerate(prompts[:-1]):
                ids.append(self.add_request(p, params[i % 2], request_id=f"warmup-{tag}{i}"))
            for _ in range(2):  # the first two run alone, then the last prefill joins their decode steps
                self.step()
            ids.append(self.add_request(prompts[-1], params[0], request_id=f"warmup-{tag}{len(prompts) - 1}"))
            while any(rid in self.requests for rid in ids) or self._inflight is not None:
                self.step()
        self.verify_policy = policy
        self._seed_rng.setstate(seed_state)
        self.spec_stats = SpecStats()
        self._req_spec.clear()
        self.kv.reset_prefix_cache()
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        for G in self.runner.graph_sets.values():
            G.stats = dict.fromkeys(G.stats, 0)
        if self.runner.conf_sched is not None:  # its measured times stay: profiling them is part of warming up
            self.runner.conf_sched.reset()
        if self.verify_policy is not None:  # the warm-up's acceptance says nothing of real requests: a new
            self.runner.use_verify_length(max(self.verify_policy.lengths))  # policy, at the longest block
            self.verify_policy = self.verify_policy.fresh()
            self._next_length = None
            self._last_readback = None
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def enable_adaptive_verification(self, step_time, **policy_kw) -> None:
        """Choose the drafts each step verifies among the runner's verify lengths (spec/adaptive.py):
        ``step_time(num_drafts, batch, any_sampled)`` in seconds — the profiled graphs' on a GPU."""
        lengths = self.runner.verify_lengths()
        if len(lengths) < 2 or not self.runner.graph_sets:
            raise ValueError("adaptive verification needs several verify_lengths and a graph set for each")
        self.verify_policy = VerifyLengthPolicy(tuple(lengths), step_time, AcceptanceEstimate(max(lengths)),
                                                **policy_kw)
        self._next_length = None
        self._last_readback = None  # (perf_counter, drafts verified) of the last pipelined read-back

    def enable_sampled_batch_rule(self, **rule_kw) -> None:
        """Verify ``sampled_verify_length`` drafts in batches of sampled requests only, at least
        ``sampled_verify_min_batch`` of them, and in batches with greedy requests whose size is in
        ``greedy_verify_batches``; else num_speculative_tokens (spec/adaptive.py SampledBatchRule)."""
        spec = self.spec_config
        if spec.sampled_verify_length is None or len(self.runner.graph_sets) < 2:
            raise ValueError("the sampled-batch rule needs sampled_verify_length and a graph set for each length")
        self.verify_policy = SampledBatchRule(spec.sampled_verify_length, max(self.runner.graph_sets),
                                              spec.sampled_verify_min_batch, greedy_batches=spec.greedy_verify_batches,
                                              **rule_kw)
        self._next_length = None
        self._last_readback = None

    def _choose_length(self) -> int:
        """The verify length the policy wants for the running requests (greedy and sampled counted apart;
        requests that cannot speculate, penalised ones, do not count); the current one between the
        policy's decisions."""
        from dspark.engine.runner import spec_eligible

        if not self.verify_policy.due():
            return self.runner.num_spec_tokens
        running = [r for r in self.scheduler.running if spec_eligible(r)]
        greedy = sum(r.params.greedy for r in running)
        return self.verify_policy.choose(self.runner.num_spec_tokens, greedy, len(running) - greedy)

    def _observe_pipelined(self, sched, step, result) -> None:
        """The step-time observation of adaptive verification: the interval between two pipelined
        read-backs of one length and the host's wait for the GPU in it (VerifyLengthPolicy.observe_step)."""
        now, n = time.perf_counter(), self.runner.num_spec_tokens
        last, self._last_readback = self._last_readback, (now, n)
        if last is not None and last[1] == n and result.verified:
            sampled = any(not s.request.params.greedy for s in sched.scheduled)
            self.verify_policy.observe_step(n, len(result.verified), sampled, now - last[0], result.wait_s)

    def _adapt_verify_length(self) -> None:
        """Between steps (nothing in flight): move to the length the policy chose. Drafts a request holds
        past the new length are dropped (never verified, so nothing depends on them); a request holding
        fewer verifies those in the longer graphs, padded, and drafts a full block next."""
        n = self._next_length if self._next_length is not None else self._choose_length()
        self._next_length = None
        if n == self.runner.num_spec_tokens:
            return
        self.runner.use_verify_length(n)
        for r in self.scheduler.running:
            del r.spec_token_ids[n:]
        self.verify_policy.changed()

    # ---------------------------------------------------------------- requests
    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {self.model_name!r} has no chat template")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"each message needs a string 'role' and 'content', got {m!r}")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(out, list):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request. Raises InvalidRequestError (before any work) on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.model_name!r} has no tokenizer: pass token ids")
            text: str | None = prompt
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        V = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {V})")
        if len(ids) > self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, more than max_model_len {self.config.max_model_len}"
            )
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(request_id, ids, params, seed, self.model_config.eos_token_ids, prompt=text)
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req)
        self._sent[request_id] = (0, 0)
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")
            self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---------------------------------------------------------------- one step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that produced something or ended
        (``final_only``: for every request that ended, as vLLM's FINAL_ONLY output kind; a request's
        delta fields then hold everything since its previous output, if any).

        Async scheduling (``EngineConfig.async_scheduling``, decode steps on CUDA graphs without
        speculation): a step is *launched* on the device and its tokens are read back by the next
        ``step()`` call, after that call has already launched the step after it (``_step_async``). The
        host's bookkeeping of step t (read-back, stop checks, detokenization, outputs, scheduling)
        thus overlaps the GPU's step t + 1, and outputs come one call later."""
        if self.verify_policy is not None and self._inflight is None:
            self._adapt_verify_length()
        G = self.runner.graphs  # prefill chunks beside decoders sized to the graph rows (Scheduler.schedule)
        self.scheduler.graph_rows = (G.q, G.max_batch) if G is not None and G.prefill_rows else None
        self.scheduler.prefill_on_graphs = (self.runner.prefill_on_graphs if self.config.graph_prefill_alone
                                            and self.scheduler.graph_rows is not None else None)
        self._final_only = final_only
        if self._inflight is not None:
            return self._step_async()
        sched = self.scheduler.schedule()
        self._last_readback = None  # the next read-back follows no pipelined one (spec/adaptive.py)
        touched: dict[str, Request] = {r.request_id: r for r in sched.finished}
        if sched.scheduled and self._launchable(sched):
            self._launch(sched, None)
        elif sched.scheduled and self._launchable_spec(sched):
            self._inflight = (sched, self.runner.launch_one_sync(sched, self.kv, None))
        elif sched.scheduled:
            result = self.runner.execute(sched, self.kv)
            self.scheduler.update(sched, result.new_tokens)
            self._apply(result, [self.requests[rid] for rid in result.new_tokens], touched)
        return self._outputs(touched)

    def _launchable(self, sched) -> bool:
        return (not sched.preempted and all(s.num_tokens == 1 and not s.num_spec_tokens and s.samples
                                            for s in sched.scheduled)
                and self.runner.can_launch_async([s.request for s in sched.scheduled]))

    def _launchable_spec(self, sched) -> bool:
        """A DSpark step that async scheduling can pipeline: every request verifies a full block (q = 1 + N
        rows) on the one-sync graph path, or the step's prompt chunks fit the graph as prefill rows beside
        such blocks (ModelRunner._graph_prefill)."""
        G = self.runner.graphs
        if G is None or sched.preempted or not self.runner.can_launch_spec([s.request for s in sched.scheduled]):
            return False
        return (all(s.num_tokens == G.q and s.num_spec_tokens == G.q - 1 and s.samples for s in sched.scheduled)
                or self.runner._graph_prefill(sched.scheduled))

    def _launch(self, sched, prev) -> None:
        self._inflight = (sched, self.runner.launch(sched, self.kv, prev))
        self.scheduler.launched(sched)

    def _step_async(self) -> list[RequestOutput]:
        """With step t in flight: launch step t + 1 for the same requests if the scheduler can tell
        now what it will be (Scheduler.can_continue), then read back step t and apply it."""
        sched, step = self._inflight
        self._inflight = None
        if step.n_out is not None:
            return self._step_async_spec(sched, step)
        if self.scheduler.can_continue(sched) and self.runner.can_launch_async([s.request for s in sched.scheduled]):
            nxt = self.scheduler.schedule()
            assert [s.request for s in nxt.scheduled] == [s.request for s in sched.scheduled] and self._launchable(nxt)
            self._launch(nxt, step)
        result = self.runner.finish(step)
        touched: dict[str, Request] = {}
        self._apply(result, self.scheduler.update_async(sched, result.new_tokens), touched)
        if self._inflight is not None and all(s.request.is_finished for s in self._inflight[0].scheduled):
            self.runner.drop(self._inflight[1])  # every request of the next step has ended: drop it
            self._inflight = None
        return self._outputs(touched)

    def _step_async_spec(self, sched, step) -> list[RequestOutput]:
        """``_step_async`` for DSpark verification steps (one-sync graph path): the next block is
        launched with its rows derived on the device from step t's outcome (ModelRunner.launch_one_sync
        with ``prev``); the host applies t afterwards as a synchronous step would (Scheduler.update:
        accepted tokens, rollback, stops), which leaves every request exactly where the launched step
        assumed it (num_computed = the step's first position, the drafts it verifies)."""
        reqs = [s.request for s in sched.scheduled]
        G = self.runner.graphs
        q = G.q
        # The launched step replays the bucket of its worst case (all drafts accepted); a synchronous
        # step would replay the bucket of its real context: go on only where the two are the same bucket
        # (the attention's key split follows the bucket, and with it the rounding). A prompt finished in
        # ``step`` starts its first block exactly at its end; admitted chunks' rows are known exactly.
        live = [s for s in sched.scheduled if not s.request.is_finished]
        lo = max((s.request.num_computed_tokens + (1 if s.num_spec_tokens else s.num_tokens) for s in live), default=0)
        hi = max((s.request.num_computed_tokens + (q if s.num_spec_tokens else s.num_tokens + q - 1) for s in live),
                 default=0)
        if self.verify_policy is not None:  # another verify length: drain the pipeline, change between steps
            n = self._choose_length()
            self._next_length = n if n != self.runner.num_spec_tokens else None
        if (live and self._next_length is None and self.runner.can_launch_spec([s.request for s in live])
                and G.bucket_for(lo + q) == G.bucket_for(hi + q)):
            nxt = self.scheduler.schedule_on_top(sched, q, lambda r, n: self.admit_on_top and self.runner.can_admit_on_top(r, n))
            if nxt is not None:
                self._inflight = (nxt, self.runner.launch_one_sync(nxt, self.kv, step))
        result = self.runner.finish_one_sync(step)
        if self.verify_policy is not None:
            self._observe_pipelined(sched, step, result)
        live_ids = {r.request_id for r in reqs if not r.is_finished}  # an abort while the step ran drops its result
        for part in (result.new_tokens, result.verified, result.drafts):
            for rid in [rid for rid in part if rid not in live_ids]:
                del part[rid]
        self.scheduler.update(sched, result.new_tokens)
        if self._inflight is not None:  # give back the worst case's blocks the launched step does not use
            for r in reqs:
                if not r.is_finished:
                    self.kv.truncate(r, r.num_computed_tokens + q)
        touched: dict[str, Request] = {}
        self._apply(result, [r for r in reqs if r.request_id in live_ids], touched)
        if self._inflight is not None and all(s.request.is_finished for s in self._inflight[0].scheduled):
            self.runner.drop(self._inflight[1])  # every request of the next step has ended: drop it
            self._inflight = None
        return self._outputs(touched)

    def _apply(self, result, reqs: list[Request], touched: dict[str, Request]) -> None:
        """After the scheduler took a step's tokens: logprobs, detokenization and stop strings for the
        requests ``reqs`` that got tokens."""
        self._record_spec(result)
        final_only = self._final_only
        for req in reqs:
            rid = req.request_id
            touched[rid] = req
            if req.logprobs is not None and rid in result.logprobs:
                req.logprobs.extend(result.logprobs[rid])
            # Final outputs only (LLM.generate) and no stop string to look for: the text is read only when
            # the request ends, so it is decoded then, all of it in one go (IncrementalDetokenizer.flush).
            # Why: at batch 32 the per-step updates were ~0.3 ms of the host's ~2.5 ms per DSpark step,
            # which set the pace at temperature 1 (H200, session 27). A request's last update is always a
            # flush, which keeps the whole characters before an unfinished last one.
            finished = req.is_finished
            if not finished and final_only and not req.params.stop:
                continue
            try:
                stop = self._detok[rid].flush() if finished else self._detok[rid].update()
            except Exception as e:  # one request's failure must not fail the batch
                req.stop_reason = f"detokenization failed: {e}"
                self.scheduler.finish(req, "error", req.stop_reason)
                continue
            if stop is not None and not req.is_finished:
                self.scheduler.finish(req, "stop", stop)
            elif stop is not None:  # finished on a token in the same step; the string came first
                req.finish_reason, req.stop_reason = "stop", stop

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        for req in self._aborted:  # aborted requests are reported once too
            touched.setdefault(req.request_id, req)
        self._aborted.clear()
        # Final outputs only (LLM.generate): no RequestOutput, with its copies of the token ids and text so
        # far, for each running request at each step. Why: at batch 128 building those was the largest part
        # of a decode step's host time (~1.5-2.2 of 4.4-5.3 ms on a 2-core CPU, session 25).
        return [self._output(r) for r in touched.values() if not self._final_only or r.is_finished]

    def _record_spec(self, result) -> None:
        self.spec_stats.draft_time_s += result.draft_time_s
        self.spec_stats.verify_time_s += result.verify_time_s
        self.spec_stats.engine_steps += 1
        pol = self.verify_policy
        est = pol.estimate if pol is not None else None
        per_req = self._req_spec
        for rid, (n, a) in result.verified.items():
            self.spec_stats.record(n, a)
            st = per_req.get(rid)
            if st is None:  # (not setdefault: that builds a SpecStats for every request at every step)
                st = per_req[rid] = SpecStats()
            st.record(n, a)
            if est is not None and rid in self.requests:
                est.observe(not self.requests[rid].params.greedy, n, a)
        if result.verified:
            n = self.runner.num_spec_tokens
            if self.runner.conf_sched is not None:  # ragged lengths: the step by its longest verification
                n = max(k for k, _ in result.verified.values())
            self.spec_stats.length_steps[n] = self.spec_stats.length_steps.get(n, 0) + 1
            if pol is not None:
                pol.tick()
        for rid, drafts in result.drafts.items():
            req = self.requests[rid]
            if not req.is_finished:
                req.spec_token_ids = drafts
            else:
                self.runner.release(rid)

    def _output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        sent_chars, sent_toks = self._sent[rid]
        toks = req.output_token_ids
        visible = len(req.output_text)
        if req.params.stop and not req.is_finished:
            # Hold back what could still become the start of a stop string (cut in a later step).
            visible = max(sent_chars, visible - (max(len(x) for x in req.params.stop) - 1))
        out = RequestOutput(
            request_id=rid,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=req.output_text[:visible],
            token_ids=toks,
            delta_text=req.output_text[sent_chars:visible],
            delta_token_ids=toks[sent_toks:],
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=None if req.logprobs is None else req.logprobs[:len(toks)],  # a snapshot, not the live list
        )
        self._sent[rid] = (visible, len(toks))
        if req.is_finished:
            if req.stats.finish_time is None:
                req.stats.finish_time = time.perf_counter()
            out.stats = req.stats.as_dict(req.num_prompt_tokens, req.num_output_tokens)
            if self.spec_config is not None:
                st = self._req_spec.pop(rid, SpecStats())
                out.stats.update({k: v for k, v in st.as_dict().items() if "time" not in k})
            self.runner.release(rid)
            del self.requests[rid], self._detok[rid], self._sent[rid]
        return out
