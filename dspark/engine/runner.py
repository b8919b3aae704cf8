"""Model runner: owns the model, the KV tensors, the sampler and (with speculation) the proposer;
turns a SchedulerOutput into emitted tokens and the next drafts.

One step:
  1. flattened inputs (input ids, positions, slot mapping, block tables, query start locations);
     the attention backend prepares its metadata once;
  2. target forward (with the drafter's tap layers when speculating);
  3. logits only for rows that decide tokens: the last row of a request that samples, or all
     1 + N rows of a request verifying N drafts;
  4. plain sampling, or verification (greedy / standard / block) of the drafts;
  5. speculation: write the drafter's context for committed rows only (rejected rows never), then
     draft the next block from the new anchor.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.config import EngineConfig
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.request import Request
from dspark.engine.scheduler import SchedulerOutput
from dspark.layers.attention import BatchLayout, TorchAttentionBackend
from dspark.layers.linear import use_batch_invariant, use_cpu_split_k, use_output_major
from dspark.models.llama import LlamaForCausalLM
from dspark.models.loader import LoadedModel
from dspark.sample.sampler import (Sampler, SamplingBatch, as_int64, draft_params, sampling_row,
                                   unfiltered)
from dspark.spec.adaptive import ConfidenceScheduler, RowTimeTable
from dspark.spec.config import SpeculativeConfig
from dspark.spec.proposer import Proposer
from dspark.spec.rejection import verify_greedy, verify_probabilistic

logger = logging.getLogger(__name__)

# A one-sync step's draft q is a view of the drafter graph's q buffer, where the next verification reads it
# (launch_one_sync, session 56); DSPARK_DRAFT_Q_CLONE=1 clones it after the drafter graph, so that every
# verification reads a staged copy (two 18.9 MB copies per batch-32 step at 3 drafts, as before: the A/B switch).
DRAFT_Q_CLONE = os.environ.get("DSPARK_DRAFT_Q_CLONE", "0") == "1"
# Of the one-sync steps a whole-step graph could run (cuda_graphs.py, WHOLE_STEP_MAX_BATCH), the first of each
# (batch size, verification kind) and then one in this many run the three graphs with a timing event between
# target and drafter: the share of the drafter in the step's GPU time, by which the whole steps' times are split.
WHOLE_SPLIT_EVERY = 16


@dataclass
class StepResult:
    new_tokens: dict[str, list[int]]  # request id -> emitted tokens (requests that sampled)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)  # per emitted token {"token", "logprob", "top"}
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts for the next step
    verified: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (drafts verified, accepted)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    wait_s: float = 0.0  # a launched step's read-back: how long the host waited for the GPU


@dataclass
class InflightStep:
    """A decode step launched on the device whose tokens the host has not read yet (async scheduling)."""
    scheduled: list  # the ScheduledRequests, in batch order
    tokens: torch.Tensor  # [B] int64 on the device: the emitted tokens (the next step's input ids)
    host: torch.Tensor  # pinned host copy of the read-back ([B] tokens; one-sync: tokens, counts, drafts),
    # valid once ``done`` has completed
    done: torch.cuda.Event | None  # recorded after the copy (None on a CPU: everything ran synchronously)
    timing: list | None  # CUDA events around the target step (and the drafter step, one-sync steps)
    t0: float
    # one-sync steps (launch_one_sync): what the next step's rows are derived from on the device
    n_out: torch.Tensor | None = None  # [B] tokens emitted per request (accepted drafts + 1): tokens[b, :n_out[b]]
    drafts: torch.Tensor | None = None  # [B, N] the drafts made from each request's last emitted token
    # [B, N, V] their q (probabilistic drafts of sampled requests): a view of the drafter graph's q buffer
    # (StepGraphs.probs), valid until that buffer's next drafter replay (ModelRunner._keep_draft_q)
    draft_q: torch.Tensor | None = None
    prob: list[bool] | None = None  # which requests drafted probabilistically
    # steps with prefill rows (StepGraphs.row_counts): each request's graph row whose outcome is its own
    # (a prefill chunk's last row) and the rows in use; None: request b is row b
    rows: list[int] | None = None
    num_rows: int | None = None
    followed: bool = False  # a step was launched on top of this one (it verifies every draft made here)
    # (padded batch, verification kind) of a step a whole-step graph could run (launch_one_sync): its timing split
    split: tuple[int, int] | None = None


def make_attention_backend(name: str, device: torch.device, batch_invariant: bool = False,
                           max_model_len: int | None = None):
    """The attention backend named by EngineConfig.resolved_attention_backend (``batch_invariant``: its
    batch-invariant attention, EngineConfig.batch_invariant or .invariant_attention). Triton is imported only
    when asked for."""
    if name == "triton":
        from dspark.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(device, batch_invariant, max_model_len)
    return TorchAttentionBackend()


def _one_sync_params(p) -> bool:
    """A request a one-sync DSpark step can verify on the device (SamplingParams.device_verifiable)."""
    return p.device_verifiable


def _one_hot_q(drafts: torch.Tensor, V: int) -> torch.Tensor:
    """[..., V] fp32 q of drafts drawn greedily: one-hot at each draft token."""
    return torch.zeros(*drafts.shape, V, device=drafts.device).scatter_(-1, drafts.unsqueeze(-1), 1.0)


def _in_buffer(t: torch.Tensor | None, buf: torch.Tensor) -> bool:
    """Whether ``t`` is a view of ``buf`` from its first row (a step's draft q in StepGraphs.probs)."""
    return t is not None and t.data_ptr() == buf.data_ptr()


def _whole_blocks(p) -> bool:
    """A seeded sampled request: with confidence scheduling it still verifies every draft it is given, so
    that its text does not follow measured step times (ConfidenceScheduler)."""
    return not p.greedy and p.seed is not None


def spec_eligible(req: Request) -> bool:
    """Penalties make the target's distribution depend on the drafts themselves: such requests
    decode without speculation."""
    return not req.params.penalized


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 spec: SpeculativeConfig | None = None, proposer_factory=None) -> None:
        """``proposer_factory`` names the target layers to tap and ``build(model) -> Proposer``s once
        the target exists (the drafter shares the target's embedding and lm_head)."""
        self.config = config
        self.device = torch.device(config.device)
        self.backend = make_attention_backend(config.resolved_attention_backend, self.device,
                                              config.batch_invariant or config.invariant_attention,
                                              config.max_model_len)
        self.model_config = mc = loaded.config
        self.max_positions = config.max_model_len + 64  # RoPE covers every reachable position, drafts included
        self.spec = spec
        self.proposer: Proposer | None = None
        tap_layers: tuple[int, ...] = ()
        if proposer_factory is not None:
            tap_layers = proposer_factory.tap_layers
        with torch.device(self.device):
            self.model = LlamaForCausalLM(mc, self.max_positions, tap_layers).to(config.dtype)
            self.model.lm_head.float()  # fp32 logits (see LlamaForCausalLM.__init__)
        self.model.load_hf_state_dict(loaded.state_dict)
        self.model.eval()
        # The Triton backend also runs the decoder's fused kernels (dspark/kernels/fused_ops.py).
        self.model.fused = config.resolved_attention_backend == "triton"
        if config.invariant_attention:
            # The invariant attention gives a row the decode step's bits in verification where both steps multiply
            # on cuBLAS (its rows' bits do not depend on the row count, session 46). The few-row kernels round apart
            # from cuBLAS, so they keep to steps of at most 16 rows, as before session 51: a plain step of 17-128
            # requests then multiplies on cuBLAS as its verification does (docs/architecture.md).
            self.model.fewrow_max_rows = 16
        if config.batch_invariant:  # every target matmul through the batch-invariant kernel
            use_batch_invariant(self.model)
            self.model.use_half_lm_head()  # CUDA, half model: its products on the tensor cores, fp32 sums
        else:  # the target's fp32 logits from half weights on CUDA (LlamaForCausalLM.use_half_lm_head)
            from dspark.layers import linear

            if self.device.type == "cuda" and linear.CUDA_OUTPUT_MAJOR:
                linear.use_output_major(self.model.layers)
            self.model.use_half_lm_head(output_major=self.device.type == "cuda" and linear.CUDA_OUTPUT_MAJOR)
            self.model.use_gemv_output_major()  # CUDA, small models: the batch-1 GEMVs read [N, K] copies
        if proposer_factory is not None:
            self.proposer = proposer_factory.build(self.model)
            if hasattr(self.proposer, "use_triton"):  # DSparkProposer: draft with the Triton kernels too
                self.proposer.use_triton = config.resolved_attention_backend == "triton"
        # Probabilistic verification, "standard" and "block": with the triton backend a fused kernel
        # each (kernels/rejection.py: same keys, same tokens; block's τ up to an ulp of h_i) instead of
        # dozens of torch ops and two Philox draws. A method missing here verifies with torch ops
        # (_verify_probabilistic).
        self._fused_verify: dict[str, Callable] = {}
        if config.resolved_attention_backend == "triton":
            from dspark.kernels.rejection import verify_block_triton, verify_standard_triton

            self._fused_verify = {"standard": verify_standard_triton, "block": verify_block_triton}
        # the fused kernels' "From logits" variant (StepGraphs._verify_step); off for good if it ever fails to build
        self.verify_from_logits = True
        self._split_k_modules: list[torch.nn.Module] = []
        self.cpu_split_k_rows: int | None = None  # the CPU: products of up to this many rows split-K (_choose_split_k_rows)
        if self.device.type == "cpu":
            drafter = getattr(self.proposer, "drafter", None)  # DSparkProposer's; test proposers have none
            modules = [self.model] + ([drafter] if isinstance(drafter, torch.nn.Module) else [])
            if config.dtype == torch.float32:  # spread one-row products over the cores (layers/linear.py)
                self._split_k_modules = modules
                for m in modules:
                    use_cpu_split_k(m)
            elif not config.batch_invariant:  # bf16/fp16: torch reads [out, in] weights ~10x faster (layers/linear.py)
                for m in modules:
                    use_output_major(m, dtypes=(torch.bfloat16, torch.float16))
        self.vocab_size = mc.vocab_size
        self.block_size = config.block_size
        elt = torch.empty((), dtype=config.dtype).element_size()
        bytes_per_block = 2 * mc.num_hidden_layers * config.block_size * mc.num_key_value_heads * mc.head_dim * elt
        if self.proposer is not None:
            bytes_per_block += self.proposer.kv_bytes_per_block(config.block_size, config.dtype)
        self.num_kv_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_memory_gb * 2**30 // bytes_per_block))
        # [L, 2 (K, V), num_blocks, block_size, Hkv, D]
        self.kv_caches = torch.zeros(
            mc.num_hidden_layers, 2, self.num_kv_blocks, config.block_size, mc.num_key_value_heads, mc.head_dim,
            dtype=config.dtype, device=self.device,
        )
        if self.proposer is not None:
            self.proposer.allocate_cache(self.num_kv_blocks, config.block_size)
        self.num_spec_tokens = 0
        if self.proposer is not None:
            self.num_spec_tokens = spec.num_speculative_tokens or self.proposer.num_slots
        # top-k / top-p rows through the fused Triton sampler with the Triton backend on a GPU (no sort of
        # the vocabulary; each row on its own programs, so batch-invariant as well)
        self.sampler = Sampler(fused=self.device.type == "cuda" and config.resolved_attention_backend == "triton")
        # request id -> (q [B, N, V] of the proposal that drafted it, its row): the q of its pending drafts
        self.draft_probs: dict[str, tuple[torch.Tensor, int]] = {}
        # DSpark steps of sampled requests verified on the device in one-sync steps (False: through
        # _verify on the host's schedule, the reference path the tests compare it with)
        self.one_sync_sampled = True
        # DSpark steps that mix prefill rows into decode/verification rows run as two sub-steps: the
        # graph-covered rows as graphs (one-sync), the rest eagerly (see execute). False: the whole mixed
        # step eagerly, the reference path the tests compare it with.
        self.split_mixed_steps = True
        self.graphs = None  # StepGraphs: decode/verify and drafter steps as CUDA graphs
        self.graph_sets: dict[int, object] = {}  # drafts verified -> its StepGraphs (adaptive verification)
        # whole-step graphs (launch_one_sync): steps seen per (batch size, kind) and the drafter's measured share
        self._whole_steps: dict[tuple[int, int], int] = {}
        self._draft_share: dict[tuple[int, int], float] = {}
        self.step_times: dict[int, dict[tuple[int, bool], float]] | None = None  # StepGraphs.profile per length
        self.conf_sched: ConfidenceScheduler | None = None  # per-request verify lengths of eager steps
        self._profiled_rows: set[int] = set()  # row counts _profile_rows has run (and so warmed) once
        # Triton's kernels on CPU tensors run in its interpreter (a test mode): a step's time there is numpy's
        # per-program work, so nothing is chosen by timing it (_choose_split_k_rows, confidence scheduling)
        self.interpreted = self.device.type != "cuda" and config.resolved_attention_backend == "triton"
        if self.device.type == "cuda" and config.resolved_attention_backend == "triton" and not config.enforce_eager:
            self.enable_graphs(capture=True)
        if self._split_k_modules and not config.batch_invariant:  # (batch-invariant mode: its own matmul)
            self._choose_split_k_rows()
        self._enable_confidence_scheduling()

    def _choose_split_k_rows(self, rounds: int = 3, margin: float = 0.05) -> None:
        """The CPU's products of two rows: split-K or oneDNN (layers/linear.py), whichever runs a whole 2-row
        target step faster here — measured, since machines of one class disagree (session 41: 24.5 ms split-K
        against 19.8 oneDNN; session 42, another VM: 42.4-44.1 against 49.2). Rounds alternate, each path
        keeps its fastest; split-K must win by ``margin``, so that near a tie the default (oneDNN) stays and
        the choice does not follow noise from one process to the next. ``DSPARK_CPU_SPLIT_K_ROWS`` (a row
        count) fixes the limit instead."""
        pinned = os.environ.get("DSPARK_CPU_SPLIT_K_ROWS", "")
        if pinned:
            if not pinned.isdigit() or int(pinned) < 1:
                raise ValueError(f"DSPARK_CPU_SPLIT_K_ROWS must be a row count >= 1, got {pinned!r}")
            rows, why = int(pinned), "DSPARK_CPU_SPLIT_K_ROWS"
        elif self.interpreted:  # the default stays (and engines in one test agree)
            rows, why = 1, "the default: Triton's interpreter runs the rest of the step"
        else:
            best = {1: float("inf"), 2: float("inf")}
            for _ in range(rounds):
                for limit in best:
                    for m in self._split_k_modules:
                        use_cpu_split_k(m, max_rows=limit)
                    best[limit] = min(best[limit], self._profile_rows(2, warm=True))
            rows = 2 if best[2] < best[1] * (1 - margin) else 1
            why = f"2-row step {1e3 * best[2]:.1f} ms split-K, {1e3 * best[1]:.1f} ms oneDNN"
        for m in self._split_k_modules:
            use_cpu_split_k(m, max_rows=rows)
        self.cpu_split_k_rows = rows
        logger.info("CPU products of up to %d row(s) through split-K, more through oneDNN (%s)", rows, why)

    def _enable_confidence_scheduling(self) -> None:
        """Confidence-scheduled verification (spec/adaptive.py ConfidenceScheduler) where steps run eagerly and
        the drafter has a confidence head, unless the config turns it off ("confidence_scheduling": false); on a
        GPU, and with Triton kernels in the CPU interpreter, only when asked for (true).
        Graph steps verify the graph's q rows per request whatever the lengths, so with CUDA graphs it is off."""
        want = None if self.spec is None else self.spec.confidence_scheduling
        head = getattr(getattr(self.proposer, "drafter", None), "confidence", None) is not None
        if want is False or self.proposer is None or not head:
            if want and self.proposer is not None:
                logger.warning("confidence_scheduling: the drafter has no confidence head; every step verifies "
                               "%d drafts", self.num_spec_tokens)
            return
        if want is None and self.device.type == "cuda":
            # Eager GPU steps are launch-bound (16-28 ms at batch 1 and 32 alike on an H100): fewer rows save
            # nothing, and scheduled was slower than every draft in 7 of 8 cells over two sessions (by 1-32 %,
            # compile stalls left out; +8 % once; docs/benchmarks.md, sessions 43-44). "confidence_scheduling":
            # true still turns it on.
            return
        if want is None and self.interpreted:
            # the measured t(R) would schedule nothing real, and profiling it at start-up took a third of an
            # engine test's time (session 63). "confidence_scheduling": true still turns it on.
            return
        if self.graphs is not None:
            if want:
                logger.warning("confidence_scheduling applies to eager steps only: with CUDA graphs every request "
                               "verifies the graph's %d drafts (verify_lengths / sampled_verify_length choose "
                               "one length per step there)", self.num_spec_tokens)
            return
        table = RowTimeTable(self._profile_rows)
        t0 = time.perf_counter()
        points = table.warm(1 + self.num_spec_tokens)  # a batch of one's rows now, not in the first request's TTFT
        logger.info("confidence scheduling: target steps of %s rows profiled in %.2f s (%s ms)", list(points),
                    time.perf_counter() - t0, ", ".join(f"{1e3 * t:.1f}" for t in points.values()))
        self.conf_sched = ConfidenceScheduler(table)

    @torch.inference_mode()
    def _profile_rows(self, rows: int, warm: bool | None = None) -> float:
        """Seconds of a target step of ``rows`` query rows (ConfidenceScheduler's t(R)): requests of up to
        1 + num_spec_tokens rows each on the dummy KV block (positions from 0: short contexts, so attention's
        share of a long-context row is left out), logits of every row as verification computes them; one
        timed run, after a warm-up run when ``warm`` (default: the first time for this row count; RowTimeTable.warm
        calls again in later rounds and keeps the minimum)."""
        if warm is None:
            warm = rows not in self._profiled_rows
        self._profiled_rows.add(rows)
        per = min(1 + self.num_spec_tokens, self.block_size)
        lens = [per] * (rows // per) + ([rows % per] if rows % per else [])
        positions = torch.cat([torch.arange(n) for n in lens])
        qsl = np.concatenate([[0], np.cumsum(lens)]).tolist()
        dev = self.device
        layout = BatchLayout(positions=positions.to(dev), slot_mapping=positions.to(dev), query_start_loc=qsl,
                             seq_lens=lens, block_tables=torch.zeros(len(lens), 1, dtype=torch.int64, device=dev),
                             block_size=self.block_size)
        meta = self.backend.prepare(layout)
        ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        for _ in range(1 + int(warm)):  # the last run is the one timed
            t0 = time.perf_counter()
            hidden, _ = self.model(ids, layout.positions, self.backend, meta, self.kv_caches)
            self.model.compute_logits(hidden)
            self._sync()
        seconds = time.perf_counter() - t0
        logger.debug("confidence scheduling: a target step of %d rows takes %.2f ms", rows, 1e3 * seconds)
        return seconds

    def enable_graphs(self, capture: bool = True, **kw) -> None:
        """Run decode/verify steps (and DSpark drafter steps) through dspark/engine/cuda_graphs.py:
        captured now as CUDA graphs, or with ``capture=False`` the same fixed-shape steps eagerly
        (how the CPU tests check them). A proposer that is not a DSpark drafter on the Triton path
        cannot be captured: then every step stays eager. With adaptive verification
        (``verify_lengths``) one set of graphs per length; ``graphs`` is the set in use."""
        from dspark.engine.cuda_graphs import StepGraphs

        lengths = self.verify_lengths()
        sets = {n: StepGraphs(self, capture=capture, n_spec=n, **kw) for n in lengths}
        graphs = sets[self.num_spec_tokens]
        if self.proposer is not None and not graphs.draft_graphs:
            logger.warning("no CUDA graphs: the proposer %s has no graph path", type(self.proposer).__name__)
            return
        try:
            for G in sets.values():
                G.capture_all()
        except RuntimeError as e:  # out of memory, an op that cannot be captured: serve eagerly instead
            if not capture:
                raise
            logger.warning("CUDA graph capture failed (%s: %s); running every step eagerly, as with "
                           "--enforce-eager (lower --max-num-seqs / --max-model-len to capture fewer graphs)",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            torch.cuda.empty_cache()
            return
        self.graphs, self.graph_sets = graphs, sets
        self.conf_sched = None  # graph steps verify q rows per request: nothing to schedule
        self.step_times = None
        if capture and len(sets) > 1 and self.spec.verify_lengths is not None:  # adaptive: profile the sets
            t0 = time.perf_counter()
            self.step_times = {n: G.profile(self.config.max_num_seqs) for n, G in sets.items()}
            ends = {n: tuple(round(1e3 * t[(b, False)], 3) for b in (min(t)[0], max(t)[0]))
                    for n, t in self.step_times.items()}
            logger.info("adaptive verification: step times of %s drafts profiled in %.1f s (ms at the smallest and "
                        "largest batch, greedy: %s)", list(sets), time.perf_counter() - t0, ends)

    def verify_lengths(self) -> list[int]:
        """The numbers of drafts a step may verify: num_speculative_tokens, and with adaptive verification
        the config's verify_lengths too, with the sampled-batch rule its sampled_verify_length (spec/adaptive.py)."""
        if self.proposer is None or self.spec is None:
            return [self.num_spec_tokens]
        v = set(self.spec.verify_lengths or ())
        if self.spec.sampled_verify_length is not None:
            v.add(self.spec.sampled_verify_length)
        return sorted(v | {self.num_spec_tokens})

    def step_time(self, n: int, batch: int, sampled: bool) -> float:
        """Profiled seconds per step verifying n drafts for ``batch`` requests (the smallest profiled
        batch size that holds them, else the largest)."""
        from dspark.engine.cuda_graphs import _pick

        table = self.step_times[n]
        sizes = sorted({b for b, _ in table})
        return table[(_pick(sizes, batch) or sizes[-1], sampled)]

    def use_verify_length(self, n: int) -> None:
        """Verify (and draft) n drafts per request from the next step on: the graph set for n. Only
        between steps, with nothing in flight (the in-flight step's outputs live in its set's buffers)."""
        self.num_spec_tokens = n
        self.graphs = self.graph_sets[n]

    def release(self, request_id: str) -> None:
        self.draft_probs.pop(request_id, None)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_batch(self, reqs: list[Request], positions: list[int], draft: bool = False) -> SamplingBatch:
        """The requests' sampling settings as tensors; ``draft``: the drafter's (draft_params)."""
        return SamplingBatch.build(
            [draft_params(r.params) if draft else r.params for r in reqs], [r.seed for r in reqs], positions,
            [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs], self.vocab_size, self.device,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        scheduled = sched.scheduled
        if self._graph_prefill(scheduled):  # prefill chunks as rows of a graph step (DSpark: one-sync)
            if self.graphs.draft_graphs:
                return self.finish_one_sync(self.launch_one_sync(sched, kv, None))
            return self.finish(self.launch(sched, kv, None))
        if self._split(scheduled):  # mixed prefill + decode/verification rows the graphs cannot take
            # Requests are independent (own KV blocks, per-request seeds and drafter context), so the two
            # halves give the tokens the whole step would, in the graphs' time for the many decode rows.
            covered = [s for s in scheduled if self.graphs.covers([s])]
            rest = [s for s in scheduled if not self.graphs.covers([s])]
            res = self.execute(SchedulerOutput(scheduled=covered), kv)
            more = self.execute(SchedulerOutput(scheduled=rest), kv)
            for name in ("new_tokens", "logprobs", "drafts", "verified"):
                getattr(res, name).update(getattr(more, name))
            res.verify_time_s += more.verify_time_s
            res.draft_time_s += more.draft_time_s
            return res
        t0 = time.perf_counter()
        dev = self.device
        ids: list[int] = []
        starts: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for s in scheduled:
            r = s.request
            a = r.num_computed_tokens
            b = a + s.num_tokens
            ids.extend(r.token_ids[a:b] if b <= r.num_tokens else (r.token_ids + r.spec_token_ids)[a:b])
            starts.append(a)
            qsl.append(qsl[-1] + s.num_tokens)
            seq_lens.append(b)
            tables.append(kv.block_ids(r.request_id))
        graph = self.graphs is not None and self.graphs.covers(scheduled)
        if graph and self._one_sync(scheduled):
            return self.finish_one_sync(self.launch_one_sync(sched, kv, None))
        taps = layout = block_tables = None
        if graph:
            # Fixed shapes: every request owns q rows, its real ones first (dspark/engine/cuda_graphs.py).
            logits_all, graph_batch, bucket = self.graphs.run_target(scheduled, ids, starts, tables)
        else:
            q_lens = torch.tensor([s.num_tokens for s in scheduled])
            req_of_row = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)  # [T]
            positions = torch.tensor(starts)[req_of_row] + torch.arange(qsl[-1]) - torch.tensor(qsl[:-1])[req_of_row]
            width = max(len(t) for t in tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
            bs = self.block_size
            slot_mapping = block_tables[req_of_row, positions // bs] * bs + positions % bs
            layout = BatchLayout(
                positions=positions.to(dev), slot_mapping=slot_mapping.to(dev), query_start_loc=qsl,
                seq_lens=seq_lens, block_tables=block_tables.to(dev), block_size=bs,
            )
            meta = self.backend.prepare(layout)
            hidden, taps = self.model(torch.tensor(ids, device=dev), layout.positions, self.backend, meta,
                                      self.kv_caches)

        result = StepResult({})
        sampling = [(b, s) for b, s in enumerate(scheduled) if s.samples]
        rejected = [0] * len(scheduled)
        if sampling:
            # Rows that decide tokens: the last 1 + n_spec rows of each sampling request.
            first_row = {b: qsl[b + 1] - 1 - s.num_spec_tokens for b, s in sampling}
            if graph:  # request b's rows start at b * q in the graph's output (every request samples)
                q = self.graphs.q
                flat = logits_all.view(-1, logits_all.shape[-1])
                if all(1 + s.num_spec_tokens == q for _, s in sampling):
                    logits = flat[:len(sampling) * q]
                else:
                    rows = [b * q + i for b, s in sampling for i in range(1 + s.num_spec_tokens)]
                    logits = flat[torch.tensor(rows).to(dev, non_blocking=True)]
            else:
                rows = torch.cat([torch.arange(first_row[b], qsl[b + 1]) for b, _ in sampling]).to(dev)
                logits = self.model.compute_logits(hidden[rows])  # [sum(1 + n_spec), V] fp32
            offset, at = {}, 0
            for b, s in sampling:
                offset[b] = at
                at += 1 + s.num_spec_tokens
            plain = [(b, s) for b, s in sampling if s.num_spec_tokens == 0]
            if plain:
                reqs = [s.request for _, s in plain]
                rows = [offset[b] for b, _ in plain]
                pl = logits[:len(rows)] if rows == list(range(len(rows))) else logits[torch.tensor(rows, device=dev)]
                toks = self.sampler(pl, self._sampling_batch(reqs, [r.num_tokens for r in reqs])).tolist()
                for r, t in zip(reqs, toks):
                    result.new_tokens[r.request_id] = [t]
            verifying = [(b, s) for b, s in sampling if s.num_spec_tokens > 0]
            if verifying:
                self._verify(verifying, logits, offset, result)
                for b, s in verifying:
                    rejected[b] = s.num_spec_tokens - (len(result.new_tokens[s.request.request_id]) - 1)
            self._logprobs(sampling, logits, offset, result)
        self._sync()
        t1 = time.perf_counter()
        result.verify_time_s = t1 - t0

        if self.proposer is not None:
            if graph and self.graphs.draft_graphs:
                committed = [s.num_tokens - rejected[b] for b, s in enumerate(scheduled)]
                self._draft(sampling, result, None, (graph_batch, bucket, committed))
            else:
                if graph:
                    raise RuntimeError("a proposer without drafter graphs needs eager target steps")
                # Committed rows only: prefill rows and, of a verification, the anchor + accepted drafts.
                keep = torch.cat([torch.arange(qsl[b], qsl[b + 1] - rejected[b]) for b in range(len(scheduled))])
                if taps is not None and keep.numel():
                    keep = keep.to(dev)
                    self.proposer.write_context(taps[keep], layout.positions[keep], layout.slot_mapping[keep])
                self._draft(sampling, result, block_tables.to(dev))
            self._sync()
            result.draft_time_s = time.perf_counter() - t1
        return result

    @torch.inference_mode()
    def launch_one_sync(self, sched: SchedulerOutput, kv: KVCacheManager, prev: InflightStep | None) -> InflightStep:
        """A decode/verify step of greedy requests as CUDA graphs, queued without waiting: target graph,
        argmax and greedy verification on the device, the drafter's inputs (committed rows, anchors,
        anchor positions) derived on the device from the outcome, drafter graph, then one asynchronous
        copy of (emitted tokens, counts, next drafts) to pinned memory; ``finish_one_sync`` reads it
        (the step's one synchronisation).

        ``prev`` (async scheduling with DSpark): the one-sync step still in flight, whose outcome decides
        the rows of this step's ``on_top`` requests (Scheduler.schedule_on_top: the requests of ``prev``
        still running, first, in prev's order; then prompts admitted as prefill rows, known on the host).
        The host still sees each on-top request as before ``prev`` (num_computed a, its drafts
        unverified, or its prompt's last chunk of L tokens not yet computed); this step's q rows
        really start at a + n_out (1 <= n_out <= q: prev verified a block at a) or a + L (n_out = 1: prev
        ended the prompt), on the device. The host writes every position-like input for the worst
        case, a + q or a + L - 1 + q (bucket, block-table width; the scheduler reserved KV blocks for
        it) and the device moves them back by q - n_out, recomputes the slots from the block table, and
        takes the input ids (the new anchor, then the drafts made from it) from prev's row of the
        request."""
        t0 = time.perf_counter()
        G = self.graphs
        q, B = G.q, len(sched.scheduled)
        scheduled = sched.scheduled
        reqs = [s.request for s in scheduled]
        host = G.flip()
        ids: list[int] = []
        starts, tables, ntok = [], [], []
        # on-top requests (first in the batch): their graph row in ``prev`` and their rows' host base
        prev_of = {} if prev is None else {id(ps.request): (i if prev.rows is None else prev.rows[i], ps)
                                           for i, ps in enumerate(prev.scheduled)}
        prev_rows: list[int] = []
        for s in scheduled:
            r = s.request
            a = r.num_computed_tokens
            if s.on_top:
                assert s.num_tokens == q, "a step launched on top of another verifies a full block per request"
                assert len(prev_rows) == len(ids) // q, "on-top requests come first"
                row, ps = prev_of[id(r)]
                prev_rows.append(row)
                # prev verified a block at a (its next block starts at a + n_out) or ended the prompt at
                # a + L (its first token, n_out = 1, starts the block at a + L): written as base + q here,
                # moved back by q - n_out on the device
                base = a if ps.num_spec_tokens else a + ps.num_tokens - 1
                ids.extend([0] * q)  # written on the device below
                starts.append(base + q)
                ntok.append(r.num_tokens + q)
            else:
                assert prev is None or not G._decode_row(s) or r.params.greedy, "only on-top blocks verify on top"
                b = a + s.num_tokens
                ids.extend(r.token_ids[a:b] if b <= r.num_tokens else (r.token_ids + r.spec_token_ids)[a:b])
                starts.append(a)
                ntok.append(r.num_tokens)
            tables.append(kv.block_ids(r.request_id))
        assert (prev is None) == (not prev_rows), "on-top requests need the step they follow"
        # Prefill rows (cuda_graphs.py): a prefill chunk takes ceil(num_tokens / q) graph rows; row_of[b] is
        # the last one, the row that emits the request's first token when the chunk ends its prompt.
        layout = G.row_layout(scheduled)
        counts = layout[0]
        row_of = (np.cumsum(counts) - 1).tolist()
        R = row_of[-1] + 1  # graph rows in use
        prefill = [b for b, p in enumerate(layout[1]) if p]
        Bg, bucket = G.prepare_target(scheduled, ids, starts, tables, ntok, layout)
        drafting = [b for b, s in enumerate(scheduled) if s.samples]
        prob = [self.spec is not None and self.spec.draft_sample_method == "probabilistic" and not r.params.greedy
                for r in reqs]
        if G.draft_graphs:
            G.prepare_sampling(Bg, [row_of[b] for b in drafting], [reqs[b].params for b in drafting],
                            [as_int64(reqs[b].seed) for b in drafting], [prob[b] for b in drafting])
        pre = set(prefill)  # never with ``prev``; a sampled prefill chunk draws its first token with the Sampler
        sampled = [b for b, r in enumerate(reqs) if not r.params.greedy and b not in pre]
        sampled_pre = [b for b in prefill if not reqs[b].params.greedy and scheduled[b].samples]
        # Verification (StepGraphs._verify_step): a graph, but for sampled requests with top-k, top-p or
        # min-p in a step too large for those graphs (FILTER_GRAPH_ROWS), where the same step runs eagerly.
        # Why: at T = 1 the eager verification was most of the host's time per step (H200, session 21:
        # 0.76 of 1.93 ms at B = 1, where the GPU step takes 1.33 ms; session 22: T = 1 DSpark 1.7x faster).
        V = self.vocab_size
        kind = G.verify_kind(bool(sampled), not all(unfiltered(reqs[b].params, V) for b in sampled))
        batch_pre = (self._sampling_batch([reqs[b] for b in sampled_pre], [reqs[b].num_tokens for b in sampled_pre])
                     if sampled_pre else None)
        # Where the verification graph reads each sampled request's q (StepGraphs.probs at q_rows): the drafter
        # graph's row of the request while its q is still there, untouched since (session 56: no copy) — prev's
        # row (on top; the host has not read prev yet) or the row of its draft_probs entry — else rows
        # G.staged + j, copied there below (one-hot q of greedy drafts, a kept copy, another graph set's q).
        staged = False
        if q > 1 and sampled:
            srows = [row_of[b] for b in sampled]
            if prev is not None:
                prows = [prev_rows[b] for b in sampled]  # prev's rows of the sampled requests (all on top)
                src = prows if _in_buffer(prev.draft_q, G.probs) else None
            else:
                es = [self.draft_probs.get(reqs[b].request_id) for b in sampled]
                src = [e[1] for e in es] if all(e is not None and _in_buffer(e[0], G.probs) for e in es) else None
            staged = src is None
            G.write_q_rows(srows, list(range(G.staged, G.staged + len(srows))) if staged else src)
        moved = None  # each request's row in prev where they moved (requests ended, admitted): uploaded below
        if prev is not None and prev_rows != list(range(len(prev_rows))):
            moved = G.write_prev_rows(prev_rows)
        G.upload(Bg)
        if prev is not None:
            prev.followed = True
            G.rows_from_previous_step(len(prev_rows), prev.n_out, prev.tokens, prev.drafts, moved)
        if staged:  # before the target graph, which may use prev.drafts' memory as scratch
            if prev is not None:
                idx = slice(0, len(prows)) if prows == list(range(len(prows))) else self._index(prows)
                dq = prev.draft_q[idx] if prev.draft_q is not None else _one_hot_q(prev.drafts[idx], V)
            else:
                d = G.input_ids[:Bg * q].view(Bg, q)[:, 1:][self._index(srows)]
                dq = self._draft_q([reqs[b] for b in sampled], d, q - 1, V)
            G.stage_q(dq)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.device.type == "cuda" else None
        # The whole step as one graph where one is captured (StepGraphs._whole_step; cuda_graphs.py says why). Its
        # GPU time is timed as a whole; the first step of each (batch size, kind) and every WHOLE_SPLIT_EVERY-th
        # run the three graphs instead, timed piece by piece, and the whole steps' times are split by the last of
        # those (finish_one_sync: verify_time_s / draft_time_s).
        split = None
        if q > 1 and not prefill and G.has_whole(Bg, bucket, kind, any(prob)):
            split = (Bg, kind)
            n = self._whole_steps[split] = self._whole_steps.get(split, -1) + 1
            if n % WHOLE_SPLIT_EVERY or not ev:
                return self._launch_whole(G, scheduled, host, ev, t0, Bg, bucket, kind, R, prev, sampled, prob, split)
        if ev:
            ev[0].record()
        logits = G.replay_target(Bg, bucket)[:R]  # [R, q, V]
        commit = None
        if q > 1:
            out, n_out, am = G.replay_verify(Bg, kind)
            out, n_out, am = out[:R], n_out[:R], am[:R]
            if prefill:
                out, n_out, commit = self._prefill_outcome(scheduled, prefill, counts, row_of, am, logits, out, n_out,
                                                           sampled_pre, batch_pre)
        else:
            out, n_out = self.sampler.argmax(logits.reshape(R, V)).view(R, 1), G.ones[:R]
        parts = [out.reshape(-1), n_out]
        if ev:
            ev[1].record()
        drafts = draft_q = None
        if G.draft_graphs:
            if prev is None and self.draft_probs:
                self._keep_draft_q(G.probs, {reqs[b].request_id for b in sampled if scheduled[b].num_spec_tokens})
            G.drafter_inputs_on_device(Bg, out, n_out, commit)
            tokens, probs = G.replay_draft(Bg, bucket, any(prob))
            parts.append(tokens[:R].reshape(-1))
            # Not cloned (session 37: a device operation and ~10 µs of the host fewer per step, each): the
            # drafts' one reader is the step launched on top of this one (rows_from_previous_step, and the
            # one-hot q of its sampled requests), which reads them before its own target graph — which may
            # use the drafter graph's output memory as scratch — and before its drafter graph rewrites
            # them, in stream order. (That step takes each anchor from ``out``, this step's emitted tokens,
            # not from G.anchors, which its upload rewrites first.) Nor is draft_q (session 56: two 18.9 MB
            # copies fewer per batch-32 step): it is G.probs, a buffer outside the graph pool that only the
            # drafter graph writes (rows below G.staged); its readers are the verification graph of the step
            # on top (at q_rows, before that step's drafter graph) or, when none follows, of the next step
            # through draft_probs, whose entries a step not verifying them copies before it replays the
            # drafter (_keep_draft_q).
            drafts = tokens[:R]
            if any(prob):
                shared = _in_buffer(probs, G.probs) and not DRAFT_Q_CLONE
                draft_q = probs[:R] if shared else probs[:R].clone()
        if ev:
            ev[2].record()
        flat = torch.cat(parts)
        hb = host[:flat.numel()]
        done = self._copy_back(hb, flat)
        G.stats["one_sync"] += 1
        if prev is not None:
            G.stats["async"] += 1
            G.stats["async_admit"] += bool(prefill)
        return InflightStep(list(scheduled), out, hb, done, ev, t0, n_out=n_out, drafts=drafts,
                            draft_q=draft_q, prob=prob, rows=row_of if prefill else None, num_rows=R, split=split)

    def _launch_whole(self, G, scheduled, host, ev, t0, Bg: int, bucket: int, kind: int, R: int,
                      prev: InflightStep | None, sampled: list[int], prob: list[bool], split) -> InflightStep:
        """launch_one_sync's tail for a step a whole-step graph runs (no prefill rows: request b is row b): the
        replay, then the copy of its read-back; the same outcome, drafts and q as the three graphs'."""
        if prev is None and self.draft_probs:  # before the graph, whose drafter rewrites G.probs (_keep_draft_q)
            reqs = [s.request for s in scheduled]
            self._keep_draft_q(G.probs, {reqs[b].request_id for b in sampled if scheduled[b].num_spec_tokens})
        if ev:
            ev[0].record()
        out, n_out, am, tokens, probs, flat = G.replay_whole(Bg, bucket, kind)
        if ev:
            ev[2].record()
            ev = [ev[0], ev[2]]  # the whole step's GPU time, split in finish_one_sync
        draft_q = None
        if any(prob):
            draft_q = probs[:R] if _in_buffer(probs, G.probs) and not DRAFT_Q_CLONE else probs[:R].clone()
        hb = host[:flat.numel()]
        done = self._copy_back(hb, flat)
        G.stats["one_sync"] += 1
        if prev is not None:
            G.stats["async"] += 1
        # the read-back is laid out for the padded batch: num_rows = Bg
        return InflightStep(list(scheduled), out[:R], hb, done, ev, t0, n_out=n_out[:R], drafts=tokens[:R],
                            draft_q=draft_q, prob=prob, num_rows=Bg, split=split)

    def _prefill_outcome(self, scheduled, prefill: list[int], counts: list[int], row_of: list[int], am: torch.Tensor,
                         logits: torch.Tensor, out: torch.Tensor, n_out: torch.Tensor, sampled_pre: list[int],
                         batch_pre: SamplingBatch | None):
        """A one-sync step's prefill rows (launch_one_sync): each commits its real rows; the last row of a
        chunk that ends its prompt emits the token after it, the argmax (greedy) or the Sampler's draw on the
        key the eager path uses (seed, num_tokens); other prefill rows emit nothing. Returns (out, n_out,
        commit) with the decode / verification rows as they were."""
        q = self.graphs.q
        rows, emit, real, last_rows, last_cols = [], [], [], [], []
        for b in prefill:
            s = scheduled[b]
            first = row_of[b] - counts[b] + 1
            for k in range(counts[b]):
                rows.append(first + k)
                real.append(min(q, s.num_tokens - q * k))
                emit.append(int(s.samples and k == counts[b] - 1))
            if s.samples:
                last_rows.append(row_of[b])
                last_cols.append((s.num_tokens - 1) % q)
        out, n_out = out.clone(), n_out.clone()
        commit = n_out.clone()
        idx = self._index(rows)
        n_out[idx] = self._index(emit)
        commit[idx] = self._index(real)
        if last_rows:
            lr, lc = self._index(last_rows), self._index(last_cols)
            out[lr, 0] = am[lr, lc]
            if sampled_pre:
                at = [last_rows.index(row_of[b]) for b in sampled_pre]
                sr, sc = lr[self._index(at)], lc[self._index(at)]
                out[sr, 0] = self.sampler(logits[sr, sc], batch_pre, no_sync=True)
        return out, n_out, commit

    def _copy_back(self, host: torch.Tensor, values: torch.Tensor) -> torch.cuda.Event | None:
        """Queue the copy of a launched step's results to pinned host memory; the event marks its end
        (None on a CPU, where it is already done)."""
        host.copy_(values, non_blocking=True)
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def finish_one_sync(self, step: InflightStep) -> StepResult:
        """Wait for a one-sync step (only for it) and turn its read-back into a StepResult. The
        timings are GPU times (CUDA events): verify_time_s = target + verification, draft_time_s =
        context store + drafting (wall time on a CPU)."""
        t0 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        vals = step.host.tolist()
        q = self.graphs.q
        B = step.num_rows or len(step.scheduled)
        result = StepResult({}, wait_s=time.perf_counter() - t0)
        n_l = vals[B * q:B * q + B]
        drafts = vals[B * q + B:]
        N = self.num_spec_tokens
        for i, s in enumerate(step.scheduled):
            if not s.samples:  # a prefill chunk short of its prompt's end
                continue
            r = s.request
            b = i if step.rows is None else step.rows[i]
            emitted = vals[b * q:b * q + n_l[b]]
            result.new_tokens[r.request_id] = emitted
            if s.num_spec_tokens:
                result.verified[r.request_id] = (s.num_spec_tokens, n_l[b] - 1)
                self.draft_probs.pop(r.request_id, None)
            if drafts:
                n = self._num_drafts(r, len(emitted))
                if n > 0:
                    result.drafts[r.request_id] = drafts[b * N:b * N + n]
                    if step.prob[i] and not step.followed:  # else the step on top verified them
                        self.draft_probs[r.request_id] = (step.draft_q, b)
        if step.timing:
            result.verify_time_s, result.draft_time_s = self._step_times(step.timing, step.split)
        else:
            result.verify_time_s = time.perf_counter() - step.t0
        return result

    def _step_times(self, ev: list, split: tuple[int, int] | None) -> tuple[float, float]:
        """(target + verification, drafter) GPU seconds of a one-sync step from its CUDA events: three around
        the target and drafter parts, or two around a whole-step graph, whose time is split by the drafter's
        share in the last step of its (batch size, kind) timed in three (launch_one_sync), which sets it."""
        if len(ev) == 2:
            total = ev[0].elapsed_time(ev[1]) / 1e3
            draft = total * self._draft_share.get(split, 0.0)
            return total - draft, draft
        verify, draft = ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3
        if split is not None:
            self._draft_share[split] = draft / max(verify + draft, 1e-12)
        return verify, draft

    def drop(self, step: InflightStep) -> None:
        """Forget a launched step (one-sync or plain) whose requests have all ended, without waiting for it:
        the device runs it to no effect (its K/V writes land at uncommitted positions of freed blocks,
        which are never hashed and which any later owner writes, in stream order after it, before it
        reads them), and its pinned set waits for it only when written next (StepGraphs.hold). Until
        session 36 the engine waited for it here, and the host's admission of the next request and that
        step's launch then ran with the GPU idle (batch 1: once per request)."""
        if self.graphs is not None:
            self.graphs.hold(step.done)

    def can_launch_spec(self, requests: list[Request]) -> bool:
        """Whether one-sync steps of these requests can be launched on top of each other (async
        scheduling with DSpark): drafter graphs, every request verified on the device (_one_sync_params:
        no penalties, no logprobs; a sampled one only with ``one_sync_sampled``). A sampled step launched
        on top of another takes its keys' positions and its drafts' q from that step on the device
        (launch_one_sync)."""
        return (self.config.async_scheduling and self.graphs is not None and self.graphs.draft_graphs
                and 0 < len(requests) <= self.graphs.max_batch
                and all(r.params.greedy_plain or (self.one_sync_sampled and self.graphs.q > 1
                                                  and _one_sync_params(r.params)) for r in requests))

    def can_admit_on_top(self, request: Request, num_tokens: int) -> bool:
        """Whether a waiting request's prompt chunk of ``num_tokens`` can join a step launched on top of
        the one in flight (Scheduler.schedule_on_top): launchable so (can_launch_spec), and not a sampled
        one-token chunk (a prefix hit up to its last token), which would be a decode row without drafts,
        sampled by the Sampler on the host (_graph_prefill does not take it either)."""
        return self.can_launch_spec([request]) and (request.params.greedy or num_tokens > 1)

    # ------------------------------------------------------------------ async scheduling
    def can_launch_async(self, requests: list[Request]) -> bool:
        """Whether a decode step of these requests can run as ``launch`` / ``finish`` (CUDA graphs, no
        speculation; each request greedy or sampled, without penalties (they count output tokens the
        host does not know yet) or logprobs, and without top-k: the sampler serves top-k rows from
        their candidates after a host check of ties, which the async path would have to replace by
        the whole-vocabulary draw (a sort of [B, V] with top-p) every step)."""
        return (self.config.async_scheduling and self.graphs is not None and self.proposer is None
                and 0 < len(requests) <= self.graphs.max_batch and all(self._plain_graph_row(r) for r in requests))

    def _plain_graph_row(self, r: Request) -> bool:
        """Whether ``launch`` can emit this request's token (the argmax, or the sampling graph's draw):
        no logprobs, no penalties, no top-k (can_launch_async)."""
        ok = r.plain_graph_row
        if ok is None:  # the params never change: decided once per request (asked twice per step)
            p, V = r.params, self.vocab_size
            ok = r.plain_graph_row = p.logprobs is None and not p.penalized and (p.greedy or sampling_row(p, V)[1] >= V)
        return ok

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, kv: KVCacheManager, prev: InflightStep | None) -> InflightStep:
        """Queue a decode step (one row per request) on the device and return without waiting for it.
        ``prev``: the step still in flight whose emitted tokens are this step's inputs, batch row for
        batch row (the engine launches a step on top of another only for the very same requests, each
        holding one pending placeholder); they are copied on the device, never through the host.

        Without ``prev``, prefill chunks may ride along as prefill rows (_graph_prefill; cuda_graphs.py):
        a chunk of L tokens takes L rows, and its last row emits the request's first token when the chunk
        ends its prompt (a chunk short of its prompt's end emits nothing)."""
        t0 = time.perf_counter()
        G = self.graphs
        scheduled = sched.scheduled
        ids, starts, tables = [], [], []
        for s in scheduled:
            r = s.request
            a = r.num_computed_tokens
            assert not s.num_spec_tokens, "launch runs decode and prefill rows only"
            ids.extend(r.token_ids[a:a + s.num_tokens])
            starts.append(a)
            tables.append(kv.block_ids(r.request_id))
        layout = G.row_layout(scheduled)
        counts = layout[0]
        R = sum(counts)  # graph rows in use
        prefill = any(layout[1])
        row_of = (np.cumsum(counts) - 1).tolist()  # request b's row whose token it emits
        if prev is None:
            assert min(ids) >= 0, "a pending input token needs the step that emits it"
        else:
            assert not prefill and len(prev.scheduled) == R, "a step launched on top of another decodes only"
            assert all(a.request is b.request for a, b in zip(prev.scheduled, scheduled))
        host = G.flip()[:R]
        reqs = [s.request for s in scheduled]
        V = self.vocab_size
        greedy = all(r.params.greedy for r in reqs)
        # Sampled rows are drawn by a sampling graph (StepGraphs._sample_step; can_launch_async keeps top-k
        # rows out), whose key positions are num_tokens (the token sampled sits there, pending placeholders
        # included). Why: the Sampler's ~15 ops and two pinned copies made sampled decode host-bound at
        # small batch (H200, session 22: plain T = 1 1.24x faster at B = 8, 1.41x at B = 32 with the graph).
        Bg, bucket = G.prepare_target(scheduled, ids, starts, tables, None if greedy else [r.num_tokens for r in reqs],
                                      layout)
        if not greedy:  # the emitting rows' settings; other rows (a prefill chunk's) take the argmax, unread
            emit = [b for b, s in enumerate(scheduled) if s.samples]
            G.prepare_sampling(Bg, [row_of[b] for b in emit], [reqs[b].params for b in emit],
                               [as_int64(reqs[b].seed) for b in emit], [False] * len(emit))
        G.upload(Bg)  # one copy; a greedy step's sampling settings go over unread
        if prev is not None:  # after the upload in stream order: overwrites the placeholders
            G.input_ids[:R].copy_(prev.tokens)
        timing = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else None
        if timing:
            timing[0].record()
        logits = G.replay_target(Bg, bucket)[:R, 0]  # [R, V]
        if greedy:
            tokens = self.sampler.argmax(logits)  # [R]
        else:
            tokens = G.replay_sample(Bg, not all(unfiltered(r.params, V) for r in reqs))[:R]
        if timing:
            timing[1].record()
        done = self._copy_back(host, tokens)
        if prefill:
            G.stats["prefill_rows"] += 1
        else:
            G.stats["async"] += 1
        return InflightStep(list(scheduled), tokens, host, done, timing, t0, rows=row_of if prefill else None,
                            num_rows=R)

    def finish(self, step: InflightStep) -> StepResult:
        """Wait for a launched step (only for it: a step queued after it keeps running) and return its
        tokens. The timing is the target step's GPU time (CUDA events), or wall time on a CPU."""
        if step.done is not None:
            step.done.synchronize()
        toks = step.host.tolist()
        rows = step.rows or range(len(step.scheduled))
        result = StepResult({s.request.request_id: [toks[b]] for s, b in zip(step.scheduled, rows) if s.samples})
        if step.timing:
            result.verify_time_s = step.timing[0].elapsed_time(step.timing[1]) / 1e3
        else:
            result.verify_time_s = time.perf_counter() - step.t0
        return result

    def _num_drafts(self, r: Request, num_emitted: int) -> int:
        """How many drafts request r gets after emitting num_emitted tokens this step (0: none).

        A request verified on the device (_one_sync_params: no penalties, no logprobs) keeps full blocks to
        the end (while it still has tokens to emit), and Scheduler.update stops at max_tokens, so the
        surplus is dropped. A greedy request's tokens are the target's argmax chain whatever the drafts;
        a sampled one's are exact samples either way, but near max_tokens a different exact sample than
        with only the drafts its remaining tokens can use (the rule before session 17): the tokens
        before the last block's end are decided by the same keys, the last one may be a verified draft
        where it was a bonus draw. Full blocks keep its steps verification blocks that async scheduling
        can pipeline (LLMEngine._launchable_spec, Scheduler.can_continue_spec): otherwise, in continuous
        batching at B = 32 some request is nearly always within a few steps of its end and every step
        of the batch ran synchronously. Requests with logprobs get only the drafts they can use, and so do
        the requests that confidence scheduling schedules (eager steps: no pipeline to keep; a draft past
        max_tokens would only be counted in its Θ), but not its seeded sampled ones, whose blocks stay whole.
        """
        if not spec_eligible(r):
            return 0
        p = r.params
        num_tokens = len(r.token_ids)  # num_tokens / num_output_tokens written out: per request per step
        left = p.max_tokens - (num_tokens - r.num_pending - len(r.prompt_token_ids) + num_emitted)
        if left <= 0:
            return 0
        n = min(self.num_spec_tokens, self.config.max_model_len - num_tokens - num_emitted)
        if _one_sync_params(p) and (self.conf_sched is None or _whole_blocks(p)):
            return n
        return min(n, left - 1)  # (eager steps with confidence scheduling: no verification pipeline to keep)

    # ------------------------------------------------------------------ verification
    def _verify(self, verifying, logits: torch.Tensor, offset: dict[int, int], result: StepResult) -> None:
        """Accept/reject each request's drafts against the target rows (anchor + N drafts)."""
        dev = self.device
        reqs = [s.request for _, s in verifying]
        nd = [s.num_spec_tokens for _, s in verifying]
        N = max(nd)
        B = len(reqs)
        V = logits.shape[-1]
        # [B, N+1] rows of the target logits, padded rows repeat the request's last row (never read). No
        # [B, N+1, V] copy of them for greedy requests (the argmax of each row, then its tokens gathered) and
        # an index_select for sampled ones: on the 2-core CPU the two advanced-indexing copies cost ~17 ms of a
        # batch-8 verification step (session 41).
        row_idx = torch.tensor([[offset[b] + min(i, n) for i in range(N + 1)] for (b, _), n in zip(verifying, nd)],
                               device=dev)
        drafts = torch.tensor([r.spec_token_ids + [0] * (N - len(r.spec_token_ids)) for r in reqs], device=dev)
        num_drafts = torch.tensor(nd, device=dev)
        greedy = [r.params.greedy for r in reqs]
        out = torch.empty(B, N + 1, dtype=torch.long, device=dev)
        n_out = torch.empty(B, dtype=torch.long, device=dev)
        gi = [i for i, g in enumerate(greedy) if g]
        if gi:
            g = torch.tensor(gi, device=dev)
            target_argmax = logits.argmax(-1)[row_idx[g]]  # [G, N+1]
            out[g], n_out[g] = verify_greedy(target_argmax, drafts[g], num_drafts[g])
        pi = [i for i, g in enumerate(greedy) if not g]
        if pi:
            p = torch.tensor(pi, device=dev)
            preqs = [reqs[i] for i in pi]
            # The target's processed distribution at each verify row; row i decides position num_tokens + i.
            batch = self._sampling_batch(preqs, [r.num_tokens for r in preqs]).repeat_rows(N + 1)
            probs = self.sampler.probs(logits.index_select(0, row_idx[p].reshape(-1)), batch).view(len(pi), N + 1, V)
            q = self._draft_q(preqs, drafts[p], N, V)
            seeds = torch.tensor([as_int64(r.seed) for r in preqs], device=dev)
            pos = torch.tensor([r.num_tokens for r in preqs], device=dev)
            method = self.spec.rejection_sample_method
            out[p], n_out[p] = self._verify_probabilistic(method, probs, drafts[p], q, num_drafts[p], seeds, pos)
        read = torch.cat([out, n_out.unsqueeze(1)], dim=1).tolist()  # one read-back: tokens, then the count
        for j, r in enumerate(reqs):
            n_emit = read[j][-1]
            result.new_tokens[r.request_id] = read[j][:n_emit]
            result.verified[r.request_id] = (nd[j], n_emit - 1)
            self.draft_probs.pop(r.request_id, None)

    def _index(self, values: list[int]) -> torch.Tensor:
        """A small int64 index on the device, copied from pinned memory without waiting for the stream
        (a pageable copy would wait for the queued target step)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _keep_draft_q(self, buf: torch.Tensor, verified: set[str]) -> None:
        """Before a drafter graph rewrites its q buffer ``buf`` in a step launched with nothing in flight:
        clone the q of draft_probs entries still in it whose requests this step does not verify (their
        drafts wait for a later step: not scheduled now). A step launched on top of another needs none:
        every request of the step below still running is on top (Scheduler.schedule_on_top), and every
        older entry was kept here when its step's successor was launched."""
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        kept: dict[int, torch.Tensor] = {}
        for rid, (t, b) in self.draft_probs.items():
            if rid not in verified and lo <= t.data_ptr() < hi:
                c = kept.get(id(t))
                if c is None:
                    c = kept[id(t)] = t.clone()
                self.draft_probs[rid] = (c, b)

    def _draft_q(self, preqs: list[Request], drafts: torch.Tensor, N: int, V: int) -> torch.Tensor:
        """[P, N, V] q of each request's pending drafts: the rows of the proposals they came from
        (self.draft_probs; rows past a request's own drafts are never read: verification masks them);
        greedy drafts are one-hot. When every request is row b of one proposal, in order, that
        proposal is q as it is (no copy)."""
        entries = [self.draft_probs.get(r.request_id) for r in preqs]
        if entries and all(e is not None for e in entries):
            src = entries[0][0]
            if all(e[0] is src and e[1] == j for j, e in enumerate(entries)) and src.shape[1] >= N:
                return src[:len(preqs), :N]
        dev = self.device
        q = torch.zeros(len(preqs), N, V, device=dev)
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        one_hot = []
        for j, e in enumerate(entries):
            if e is None:
                one_hot.append(j)
            else:
                src, row = e
                g = groups.setdefault(id(src), (src, [], []))
                g[1].append(j)
                g[2].append(row)
        for src, js, rows in groups.values():
            n = min(N, src.shape[1])
            q[self._index(js), :n] = src[self._index(rows).to(src.device), :n]
        if one_hot:
            oh = self._index(one_hot)
            q[oh] = _one_hot_q(drafts[oh], V)
        return q

    def _split(self, scheduled) -> bool:
        """Whether a step the graphs do not cover runs as two sub-steps (execute): with DSpark only, when
        the decode/verification rows (every request but the prefilling ones) form a graph step. Measured
        on the H200 (session 13, bench cells of 128 prompts at concurrency 32, greedy): a mixed DSpark step
        run eagerly cost ~20 ms against ~2 ms for a graph step, and every admission makes one, so
        continuous batching ran at 0.32x of plain against 0.74x in static waves. Without DSpark an eager
        mixed step costs about one extra graph step, which a second forward would not save."""
        if self.graphs is None or self.proposer is None or not self.split_mixed_steps:
            return False
        covered = [s for s in scheduled if self.graphs.covers([s])]
        return 0 < len(covered) < len(scheduled) and self.graphs.covers(covered)

    def _graph_prefill(self, scheduled) -> bool:
        """Whether a step with prefill chunks runs as one graph step, each chunk as q-token rows
        (StepGraphs.covers_prefill) and the rows fit: with DSpark a one-sync step, every request one-sync
        (_one_sync_params; a sampled decode row verifies drafts); without, a ``launch`` of the decode graph
        (one row per prompt token), every request one whose token it can emit (_plain_graph_row). Measured
        on the H200 (session 16, `dspark bench` B=32 continuous cell, greedy DSpark): 69 admission steps ran
        as a graph sub-step + an eager prefill sub-step at 20.5 ms each, 1.41 s of the cell's 2.41 s."""
        G = self.graphs
        if G is None or not G.covers_prefill(scheduled):
            return False
        if not G.draft_graphs:  # plain decode graphs (launch): rows whose token launch can emit
            return all(self._plain_graph_row(s.request) for s in scheduled)
        return all(_one_sync_params(s.request.params)
                   and (s.request.params.greedy or s.num_spec_tokens > 0 or not G._decode_row(s)) for s in scheduled)

    def prefill_on_graphs(self, req: Request) -> bool:
        """_graph_prefill's condition for one request's prefill chunk: with DSpark a request a one-sync step
        verifies on the device, without a request whose token ``launch`` can emit (Scheduler.schedule,
        EngineConfig.graph_prefill_alone)."""
        G = self.graphs
        if G is None or not G.prefill_rows:
            return False
        return _one_sync_params(req.params) if G.draft_graphs else self._plain_graph_row(req)

    def _one_sync(self, scheduled) -> bool:
        """Whether this graph step runs as launch_one_sync + finish_one_sync: greedy requests that need
        only the argmax, or (DSpark) requests that verify drafts on the device (_one_sync_params), every
        sampled one with drafts to verify (a sampled request without drafts is sampled by the Sampler, on
        another key stream than verification's)."""
        if all(s.request.params.greedy_plain for s in scheduled):
            return True
        return (self.one_sync_sampled and self.graphs.q > 1 and self.graphs.draft_graphs
                and all(_one_sync_params(s.request.params) and (s.request.params.greedy or s.num_spec_tokens > 0)
                        for s in scheduled))

    def _verify_probabilistic(self, method: str, *args: torch.Tensor, target_stats: torch.Tensor | None = None,
                              draft_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification by ``method`` (SpeculativeConfig.rejection_sample_method) of (probs, drafts, q,
        num_drafts, seeds, positions), through the method's fused kernel when there is one; if it fails
        (a Triton compile error on a GPU it was never run on), warn once and stay on the torch path for
        that method, which gives the same tokens (block: up to a near-tie U_i ≈ h_i, kernels/rejection.py).
        ``target_stats`` [B, N+1, 3]: the first argument holds the target's logits, each row's probabilities
        given by its (t, M, Z) (softmax.temperature_softmax_stats; the kernel's "From logits"). ``draft_rows`` [B]:
        request b's q is row draft_rows[b] of the third argument (the kernels' "Draft rows")."""
        kernel = self._fused_verify.get(method)
        if target_stats is not None:
            if kernel is not None and self.verify_from_logits:
                try:
                    return kernel(*args, max_drafts=self.num_spec_tokens, target_stats=target_stats,
                                  draft_rows=draft_rows)
                except Exception as e:  # noqa: BLE001 (the variant reading probabilities, below, is equivalent)
                    logger.warning("verification from logits failed (%s: %s); verifying from probabilities from now "
                                   "on", type(e).__name__, e)
                    self.verify_from_logits = False
            from dspark.kernels.softmax import probs_from_stats  # the others read probabilities

            x = args[0]
            args = (probs_from_stats(x.reshape(-1, x.shape[-1]), target_stats.reshape(-1, 3)).view(x.shape), *args[1:])
        if kernel is not None:
            try:  # every N up to the block size on one compiled kernel (kernels/rejection.py, "Compiled variants")
                return kernel(*args, max_drafts=self.num_spec_tokens, draft_rows=draft_rows)
            except Exception as e:  # noqa: BLE001 (any compile/launch failure: the torch path is equivalent)
                self._drop_fused_verify(method, e)
        if draft_rows is not None:
            args = (*args[:2], args[2].index_select(0, draft_rows), *args[3:])
        return verify_probabilistic(*args, method=method)

    def _drop_fused_verify(self, method: str, error: Exception) -> None:
        """Verify ``method`` with torch ops from now on (its fused kernel failed to build or launch), warning once."""
        logger.warning("fused verification kernel failed (%s: %s); verifying %s with torch ops from now on",
                       type(error).__name__, error, method)
        del self._fused_verify[method]

    def precompile_verification(self) -> int:
        """Build the configured method's fused verification kernels for every draft count and batch
        size before serving (kernels/rejection.py ``precompile``): an eager step (--enforce-eager, or a step the
        graphs do not cover) would otherwise compile one the first time its count of drafts or of sampled
        requests came up — under confidence scheduling on an H100, 1.3-1.7 s inside a timed bench call
        (session 43). Returns the verifications run (0 where there is nothing to build). A kernel that fails
        to build is dropped as _verify_probabilistic drops it: the torch path verifies that method."""
        method = self.spec.rejection_sample_method if self.spec is not None else None
        if not self.num_spec_tokens or method not in self._fused_verify:  # (the triton backend only: a GPU, or
            return 0  # the CPU in Triton's interpreter, as the tests run it)
        from dspark.kernels.rejection import precompile

        try:
            runs = precompile(method, self.vocab_size, self.num_spec_tokens, self.device)
        except Exception as e:  # noqa: BLE001 (as _verify_probabilistic: the torch path is equivalent)
            self._drop_fused_verify(method, e)
            return 0
        G = self.graphs
        if G is not None and G.draft_graphs:  # the verification graphs' variants (StepGraphs._verify_step), for the
            try:  # filtered steps above FILTER_GRAPH_ROWS, which run that verification eagerly
                runs += precompile(method, self.vocab_size, self.num_spec_tokens, self.device, draft_rows=True)
            except Exception as e:  # noqa: BLE001 (as _verify_probabilistic: the torch path is equivalent)
                self._drop_fused_verify(method, e)
                return runs
        if self.verify_from_logits:  # the sampled verification graph's variant (StepGraphs._verify_step)
            try:
                runs += precompile(method, self.vocab_size, self.num_spec_tokens, self.device, from_logits=True,
                                   draft_rows=True)
            except Exception as e:  # noqa: BLE001 (as _verify_probabilistic: from probabilities instead)
                logger.warning("verification from logits failed to build (%s: %s); verifying from probabilities",
                               type(e).__name__, e)
                self.verify_from_logits = False
        return runs

    def _logprobs(self, sampling, logits: torch.Tensor, offset: dict[int, int], result: StepResult) -> None:
        want = [(b, s) for b, s in sampling if s.request.params.logprobs is not None]
        if not want:
            return
        rows, toks, owners = [], [], []
        for b, s in want:
            emitted = result.new_tokens[s.request.request_id]
            for j, t in enumerate(emitted):  # emitted token j was decided by verify row j
                rows.append(offset[b] + j)
                toks.append(t)
                owners.append(s.request)
        k = max(s.request.params.logprobs for _, s in want)
        dev = self.device
        lp, top_ids, top_lp = self.sampler.logprobs(logits[torch.tensor(rows, device=dev)],
                                                    torch.tensor(toks, device=dev), k)
        lp, top_ids, top_lp = lp.tolist(), top_ids.tolist(), top_lp.tolist()
        for i, r in enumerate(owners):
            n = r.params.logprobs
            result.logprobs.setdefault(r.request_id, []).append(
                {"token": toks[i], "logprob": lp[i], "top": list(zip(top_ids[i][:n], top_lp[i][:n]))}
            )

    # ------------------------------------------------------------------ drafting
    def _draft(self, sampling, result: StepResult, block_tables: torch.Tensor | None, graph=None) -> None:
        """Draft the next block for every request that emitted tokens this step; ``graph`` (padded
        batch, bucket, committed rows per request): store the context and draft in a drafter graph."""
        cand = []
        for b, s in sampling:
            r = s.request
            emitted = result.new_tokens[r.request_id]
            n = self._num_drafts(r, len(emitted))
            if n > 0:
                cand.append((b, r, emitted[-1], r.num_tokens + len(emitted) - 1, n))
        if not cand:
            if graph is not None:  # the committed rows' context is still stored; no drafts wanted
                self.graphs.run_draft(*graph, [], [], [], [], [], [])
            return
        reqs = [c[1] for c in cand]
        prob = [self.spec.draft_sample_method == "probabilistic" and not r.params.greedy for r in reqs]
        if graph is not None:
            tokens, probs = self.graphs.run_draft(*graph, [c[0] for c in cand], [c[2] for c in cand],
                                                  [c[3] for c in cand], [r.params for r in reqs],
                                                  [as_int64(r.seed) for r in reqs], prob)
            toks = tokens.tolist()
        else:
            sched = self.conf_sched
            if sched is not None:
                # seeded sampled requests verify every draft (ConfidenceScheduler: their text follows their seed)
                fixed = [_whole_blocks(r.params) for r in reqs]
                key = frozenset(r.request_id for r in reqs)
                if not any(fixed) and sched.pause_step(key):
                    return  # speculation paused: these requests decode plainly next step
            dev = self.device
            N = max(c[4] for c in cand)
            anchors = torch.tensor([c[2] for c in cand], device=dev)
            anchor_pos = torch.tensor([c[3] for c in cand], device=dev)
            batch = self._sampling_batch(reqs, [c[3] + 1 for c in cand], draft=True)
            t0 = time.perf_counter()
            prop = self.proposer.propose(reqs, anchors, anchor_pos, block_tables[[c[0] for c in cand]], N, batch, prob)
            tokens, probs = prop.tokens, prop.probs
            toks = tokens.tolist()  # (waits for the proposal)
            if sched is not None and prop.confidence is not None:
                seconds = time.perf_counter() - t0
                # a_{r,j}, non-increasing in j (as the admission's order needs) whatever the rounding
                survival = torch.cummin(prop.confidence.nan_to_num(0.0).cumprod(dim=1), dim=1).values.tolist()
                others = sum(not spec_eligible(s.request) for _, s in sampling)  # one row each next step
                # (the first schedules profile target steps on the dummy block: after this step's rows were used)
                ell = sched.schedule([a[:c[4]] for a, c in zip(survival, cand)], fixed, others, key)
                sched.observe_draft(len(cand), seconds)  # after the schedule: a draft's time never steers its own
                cand = [c[:4] + (l,) for c, l in zip(cand, ell)]
        for j, (_, r, _, _, n) in enumerate(cand):
            if n == 0:  # (confidence scheduling: no draft worth a row) decodes plainly next step
                continue
            result.drafts[r.request_id] = toks[j][:n]
            if prob[j]:
                self.draft_probs[r.request_id] = (probs, j)  # row j of this proposal's q [B, N, V]
