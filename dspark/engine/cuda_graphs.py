"""CUDA graphs for the engine's steady state: the target's decode / verification step and the whole
DSpark drafter step, at padded batch sizes and per context-length bucket.

Why: for a 135M model on an H200 a step is a few hundred small kernels; launched one by one from
Python each costs far more on the host than on the GPU (../shared/docs/gpu.md: 18–25 ms eager vs
3 ms as one graph for a plain-PyTorch SmolLM2 step). A graph replays them with one launch.

What is captured (only with the triton attention backend on CUDA, unless ``enforce_eager``):

- **Target graphs**, one per (padded batch size B, context bucket). Every request of the batch owns
  exactly ``q`` query rows: q = 1 without speculation (decode), q = 1 + N with it (verification of
  N drafts; a request verifying fewer drafts, or decoding one token, fills its rows with padding).
  The graph runs the model (fused kernels, paged attention), the fp32 logits of all B·q rows, and
  copies the taps the drafter needs into a fixed buffer.
- **Drafter graphs**, one per (B, bucket, greedy | probabilistic): the drafter's context store for
  the committed rows (a ``valid`` mask skips rejected and padding rows) and the whole proposal —
  block pass, drafter attention over the paged context, base logits, the fused Markov sampler over
  all N slots (not the confidence head: nothing in the engine reads c_k yet).
- **Verification graphs** (q > 1), one per (B, kind): after the target graph, the argmax and greedy
  verification of every row and, for sampled rows, their processed distributions and the fused
  rejection kernel (``_verify_step``; the runner picks the kind, ``verify_kind``).
- **Whole-step graphs** (q > 1, batch sizes up to whole_step_max_batch: 16 where captured), one per
  (B, bucket, greedy | sampled): a one-sync step without prefill rows as one graph — the target, verification
  and drafter steps above with the drafter's inputs between them and the read-back's concatenation after
  (``_whole_step``).
  The three graphs above still serve the steps it does not (prefill rows, the filtered kind, larger
  batches, a step timed piece by piece: ModelRunner.launch_one_sync).
- **Sampling graphs** (q = 1), one per (B, with top-p / min-p or not): the draw of a launched decode
  step (``_sample_step``, the Sampler's own ops).
- A step qualifies when every scheduled request samples and has no prefill rows (each runs
  1 + its drafts rows), and the batch fits the largest captured size; with DSpark, prefill chunks
  can ride along as prefill rows (below); anything else runs eagerly, as with ``enforce_eager``.

Padding (the graphs have fixed shapes): a request with q_b < q real rows gets q − q_b extra rows
after its real ones, at positions after its own; its seq_len grows by as many, so its real rows keep
their positions (the kernels derive a row's position from seq_len) and see nothing new (causal).
Padding requests (b ≥ the real batch) decode q rows at positions 0..q−1 of the dummy block 0.
Every padding row writes its K/V to slot 0 of the dummy block (kv_cache.py: never live), so nothing
live is ever touched; its outputs are never read.

Prefill rows: a step that mixes prefill chunks with verification rows (every admission in continuous
batching) replays the verification graph too, each chunk of L tokens cut into
ceil(L / q) rows of q tokens (the last one partial, padded as above), each row a pseudo-request with the
chunk's block table, positions start + q·k .. and seq_len start + q·(k + 1). That is exact chunked
prefill: every layer writes all rows' K/V before its attention reads the paged cache, so row k of a chunk
sees rows < k of the same step (and itself causally). The runner (launch_one_sync) commits every real row
of a prefill row to the drafter's context, and only the last row of a chunk that ends its prompt emits
a token (the argmax at its last real row, or the Sampler's draw for a sampled request) and drafts from it;
other prefill rows draft too (reads only) and are never read. Batch sizes are captured up to max_num_seqs
+ ceil(graph_prefill_tokens / q) rows; a step whose rows do not fit falls back to the split (graph
verification + eager prefill). Why (H200, session 16): an eager prefill sub-step cost ~18 ms (hundreds of
launches from Python), against ~2 ms for a graph step, and continuous batching at B=32 made ~70 of them.
Without speculation (q = 1) the plain decode graph takes prefill rows the same way, one prompt token per
row (ModelRunner.launch: the last row of a chunk that ends its prompt is the request's decode row; the
sampling graph draws it on the eager path's key, (seed, num_tokens)), for requests the sampling graphs
serve (no top-k, penalties or logprobs); batch sizes go up to max_num_seqs + graph_prefill_tokens. Why
(H200, session 23, `dspark serve` at 32 streams, natural EOS): every admission was an eager mixed step of
~18–20 ms that held up every stream, and admissions came one at a time.

Context buckets (seed 000): the paged-attention kernels read each request's seq_len at run time, so
a graph's loop bounds already follow the real context; what capture fixes is the split of the key
range over programs (flash-decoding), sized by the longest context the graph expects. So each
graph is captured for a bucket of the batch's longest context (powers of two from 512, up to
max_model_len) and the smallest bucket that covers the batch is replayed: a 1k-context step under
max_model_len 8192 does the work of the 1k graph, not the 8k one.

Inputs live in fixed device buffers written before each replay (one host->device copy of the packed
integer inputs, one of the block tables); the large outputs (fp32 logits, the drafts' q) go to
buffers shared by all graphs of a kind, the small ones stay in each graph's own tensors (kept alive,
so graphs captured later never take their memory) and are read or cloned before any graph captured
earlier replays, whose scratch may lie there (verification's outputs, read after the drafter graph,
have fixed buffers for that reason). ``capture=False`` runs the very same padded, fixed-shape
step eagerly: on a CPU (Triton's interpreter) the tests check all the padding logic that way.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch

from dspark.sample.sampler import SamplingBatch, sampling_row

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
SMALLEST_BUCKET = 512
# Verification graphs with top-k / top-p / min-p (a sort of every row's vocabulary: its scratch is ~30 bytes
# per row and token, 750 MB at 512 rows of SmolLM2's 49,152) are captured up to this many rows; larger
# steps run the same verification eagerly (replay_verify).
FILTER_GRAPH_ROWS = 512
# the kinds of verification graph (StepGraphs._verify_step)
VERIFY_GREEDY, VERIFY_SAMPLED, VERIFY_FILTERED = 0, 1, 2
# VERIFY_SAMPLED with a fused verification kernel reads the logits and each row's (t, M, Z) instead of written
# probabilities (kernels/rejection.py, "From logits": the same tokens); DSPARK_VERIFY_FROM_LOGITS=0 writes them
# (the A/B switch).
VERIFY_FROM_LOGITS = os.environ.get("DSPARK_VERIFY_FROM_LOGITS", "1") != "0"
# ... in graphs of at least this many rows (B x q). H100, session 55 (kernel_rejection_bench.py --from-logits, 3
# drafts, CUDA-graph µs of softmax + verification): 128 rows block 64.8 -> 59.8, standard 55.5 -> 45.9; 32 rows block
# 31.4 -> 33.5 (the stats launch costs more than the write it saves), standard 26.9 -> 25.5.
VERIFY_FROM_LOGITS_MIN_ROWS = 128
# Whole-step graphs (StepGraphs._whole_step): a one-sync DSpark step without prefill rows as ONE graph — target,
# verification, the drafter's inputs, drafter, and the read-back's concatenation — at batch sizes up to this
# many requests, greedy and sampled (not the filtered kind: it falls back to the three graphs). Why (H100, session
# 62, benchmarks/fused_step_probe.py, GPU µs per step with PDL): the step as the engine queued it in three graphs
# with a kernel and three timing events between them, then a concatenation, took 902 / 1010 / 1412 / 1889 µs at
# batch 1 / 8 / 16 / 32 (greedy); as one graph with two events 875 / 996 / 1398 / 1895 and 864 / 984 / 1386 / 1865
# without the read-back: every graph boundary is a launch whose first kernel cannot start early (PDL works inside
# a graph), and each small operation between graphs costs device time of its own. Above 16 the gain was within
# noise and every size costs graphs to capture (buckets x 2 per size and graph set). End to end (H100, session 64,
# benchmarks/whole_step_ab.py, one engine flipping it between alternating calls, the same tokens): batch 1 +5.7 %
# greedy and +3.2 % at temperature 1 (0.968 -> 0.916 ms per step greedy), batch 8 +1.9 % / +3.1 %. So ON where the
# graphs are captured (CUDA); capture=False (the CPU tests' graph steps) keeps the three graphs unless this is set.
# None: that default; DSPARK_WHOLE_STEP=1 / 0: on (16) / off (0) everywhere.
WHOLE_STEP_BATCHES = 16
_WHOLE_ENV = os.environ.get("DSPARK_WHOLE_STEP")
WHOLE_STEP_MAX_BATCH: int | None = None if _WHOLE_ENV is None else WHOLE_STEP_BATCHES if _WHOLE_ENV == "1" else 0


def whole_step_max_batch(capture: bool) -> int:
    """The largest batch a whole-step graph runs (0: none): WHOLE_STEP_MAX_BATCH, or by default 16 for captured
    graphs and 0 for capture=False."""
    if WHOLE_STEP_MAX_BATCH is not None:
        return WHOLE_STEP_MAX_BATCH
    return WHOLE_STEP_BATCHES if capture else 0


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: the usual steps up to max_num_seqs, and max_num_seqs itself."""
    return sorted({b for b in GRAPH_BATCH_SIZES if b < max_num_seqs} | {max_num_seqs})


def context_buckets(max_len: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` below max_len, then max_len (the full-length graph)."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def _pick(sizes: list[int], n: int) -> int | None:
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (capture=False)
    outputs: tuple


class StepGraphs:
    """The captured graphs of one ModelRunner and their fixed input buffers (see the module docstring)."""

    def __init__(self, runner, capture: bool = True, batch_sizes: list[int] | None = None,
                 buckets: list[int] | None = None, n_spec: int | None = None) -> None:
        """``n_spec``: the drafts each request verifies (default the runner's num_spec_tokens); with
        adaptive verification (spec/adaptive.py) the runner holds one StepGraphs per length."""
        from dspark.layers.triton_attention import TritonAttentionBackend, TritonAttentionMetadata
        from dspark.spec.proposer import DSparkProposer

        if not isinstance(runner.backend, TritonAttentionBackend):
            raise ValueError("CUDA graphs need the triton attention backend")
        self._meta_cls = TritonAttentionMetadata
        self.runner = runner
        self.capture = capture
        cfg = runner.config
        self.block_size = bs = cfg.block_size
        self.n_spec = runner.num_spec_tokens if n_spec is None else n_spec
        self.q = q = 1 + self.n_spec
        prop = runner.proposer
        self.draft_graphs = isinstance(prop, DSparkProposer) and prop.use_triton and self.n_spec > 0
        # Prefill rows (module docstring): room for graph_prefill_tokens prompt tokens as q-token rows
        # besides max_num_seqs requests' verification rows (DSpark), or as one-token rows besides their
        # decode rows (no proposer: the plain decode graphs, q = 1).
        plain = prop is None and q == 1
        self.prefill_rows = -(-cfg.graph_prefill_tokens // q) if (self.draft_graphs and q > 1) or plain else 0
        self.batch_sizes = batch_sizes or graph_batch_sizes(cfg.max_num_seqs + self.prefill_rows)
        max_len = cfg.max_model_len + q  # a padded request's seq_len reaches max_model_len + q - 1
        self.buckets = buckets or context_buckets(max_len)
        dev = runner.device
        Bm = max(self.batch_sizes)
        Tm = Bm * q
        self.max_batch, self.max_rows = Bm, Tm
        self.width = -(-max_len // bs)
        V = runner.vocab_size
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        pin = dev.type == "cuda"
        # Device inputs, packed by type, from pinned host twins (the numpy views ``_h*``):
        #   ints  [input ids (Tm) | positions (Tm) | slots (Tm) | anchors (Bm) | anchor pos (Bm) | top-k (Bm)
        #          | seeds (Bm) | drafts to verify (Bm) | tokens before the step (Bm) | each row's q row (Bm)
        #          | each row's row in the step below (Bm)]
        #   floats [temperature (Bm) | top-p (Bm) | min-p (Bm) | each row's temperature (Tm)]
        #   flags [valid rows (Tm) | probabilistic (Bm)]
        # and all five are views of one byte buffer, block tables last, so that a whole step's inputs go
        # over in **one** host->device copy (``upload``: the bytes up to the batch's last block-table row).
        # Why: each copy is a separate operation on the stream, several µs of device time however small
        # (session 37, CUDA events between the pieces of a batch-1 step: 5-12 µs for each small copy or
        # kernel outside the graphs), and ~10 µs of the host's time; a DSpark step queued five of them.
        shapes = [(torch.float32, (3 * Bm + Tm,)), (torch.int32, (Bm,)), (torch.bool, (Tm + Bm,)),
                  (torch.int64, (3 * Tm + 8 * Bm,)), (torch.int64, (Bm, self.width))]
        offsets, n = [], 0
        for dt, shape in shapes:
            offsets.append(n)
            n += -(-math.prod(shape) * dt.itemsize // 64) * 64  # every section 64-byte aligned
        self._bt_off, self._bt_row = offsets[-1], self.width * 8

        def sections(buf: torch.Tensor) -> list[torch.Tensor]:
            return [buf[o:o + math.prod(sh) * dt.itemsize].view(dt).view(sh) for o, (dt, sh) in zip(offsets, shapes)]

        self._dev_bytes = torch.zeros(n, dtype=torch.uint8, device=dev)
        self.floats, self.seq_lens, self.flags, self.ints, self.block_tables = sections(self._dev_bytes)
        # Two sets of host twins, used in turn by ``flip``: with async scheduling the host fills step t+1's
        # inputs while step t's copy from the other set may still be queued on the device.
        self._pinned_bytes = [torch.zeros(n, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._pinned_sets = []
        for buf in self._pinned_bytes:
            hf, hs, hb, hi, ht = sections(buf)
            self._pinned_sets.append([hi, hf, hb, hs, ht])
        self._views = [tuple(t.numpy() for t in ts) for ts in self._pinned_sets]
        # A launched step's read-back through pinned memory (two, in turn): its emitted tokens [Bm, q], the
        # counts [Bm] and the next drafts [Bm, N] (a plain decode step uses the first Bm).
        self._token_host = [torch.zeros(Bm * (2 * q), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._set = 0
        self._use_set(0)
        # set -> the completion event of a launched step that will not be read back (``hold``)
        self._held: dict[int, torch.cuda.Event] = {}
        # set -> what prepare_sampling last wrote into it (its arguments; the params objects themselves, held
        # so their ids stay theirs): a step with the same rows, requests and flags skips the rewrite
        self._sampling_written: list[tuple | None] = [None, None]
        self.input_ids, self.positions, self.slot_mapping = (self.ints[i * Tm:(i + 1) * Tm] for i in range(3))
        (self.anchors, self.anchor_pos, top_k, seeds, self.num_drafts, self.num_tokens, self.q_rows,
         self.prev_rows) = (self.ints[3 * Tm + i * Bm:3 * Tm + (i + 1) * Bm] for i in range(8))
        temperature, top_p, min_p = (self.floats[i * Bm:(i + 1) * Bm] for i in range(3))
        # request b's temperature on its q rows (verification's softmax; written by prepare_sampling, not repeated
        # on the device at every replay)
        self.row_temperature = self.floats[3 * Bm:3 * Bm + Tm]
        self.valid, self.prob_mask = self.flags[:Tm], self.flags[Tm:]
        self.query_start_loc = (torch.arange(Bm + 1, dtype=torch.int32) * q).to(dev)
        self.ones = torch.ones(Bm, dtype=torch.int64, device=dev)  # one token emitted per plain decode row
        # Outputs every graph of a kind shares (a graph's other outputs are small): the target's fp32
        # logits and the drafts' q. Each is read before the next replay of its kind (stream order).
        self.logits = torch.empty(Tm, V, **f32)
        # The drafts' q: the drafter graph writes rows [0, Bg), outside the graph pool; a sampled verification
        # graph reads graph row b's q at row q_rows[b] (session 56: where the drafter wrote it, no copy; rows
        # [Bm, 2 Bm) take the q of drafts from elsewhere, stage_q). Rows no sampled request reads hold stale
        # values (in bounds: every q_rows value written is).
        self.probs = torch.zeros(2 * Bm, self.n_spec, V, **f32) if self.draft_graphs else None
        self.staged = Bm  # stage_q's first row
        # Verification's outputs (tokens, emitted counts, argmax) in fixed buffers, not in the graph pool: the
        # drafter graph replays between the verification and the read of its outputs (the step's read-back,
        # the next step's rows_from_previous_step), and a graph captured before another one uses the
        # memory of the later graph's outputs as scratch.
        self.v_out = torch.zeros(Bm, q, **i64)
        self.v_n = torch.zeros(Bm, **i64)
        self.v_am = torch.zeros(Bm, q, **i64)
        self.taps = None
        if runner.proposer is not None and runner.model.tap_layers:
            mc = runner.model_config
            self.taps = torch.zeros(Tm, len(runner.model.tap_layers) * mc.hidden_size, dtype=cfg.dtype, device=dev)
        # The sampling settings every graph that samples reads (prepare_sampling writes them).
        self.sampling = SamplingBatch(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
            positions=torch.zeros(Bm, **i64), repetition_penalty=torch.ones(Bm, **f32),
            frequency_penalty=torch.zeros(Bm, **f32), presence_penalty=torch.zeros(Bm, **f32),
            all_greedy=False, all_random=False, no_top_k=False, no_top_p=False, no_min_p=False,
            no_penalties=True, max_top_k=V,
        )
        if self.draft_graphs:
            # top-k, top-p, min-p that filter nothing, never written: the drafter's first Bm rows (sampler.draft_params;
            # the uploaded ones are verification's) and VERIFY_SAMPLED's B x q rows (_verify_step)
            self._neutral_rows = (torch.full((Tm,), V, **i64), torch.ones(Tm, **f32), torch.zeros(Tm, **f32))
        self.s_out = torch.zeros(Bm, **i64)  # a sampling graph's tokens (a fixed buffer: see v_out)
        # Whole-step graphs (whole_step_max_batch) up to this batch size, and the buffer they concatenate the
        # step's read-back into ([tokens Bg x q | emitted Bg | drafts Bg x N] of the padded batch): read by the copy
        # to the host queued right after the replay, rewritten by the next whole step's replay, in stream order.
        self.whole_max_batch = whole_step_max_batch(capture) if self.draft_graphs and q > 1 else 0
        self.flat = torch.zeros(Bm * (q + 1 + self.n_spec), **i64) if self.whole_max_batch else None
        # drafts probabilistic in a step of each verification kind (whole-step graphs fix it at capture): sampled
        # requests draft probabilistically exactly when the config says so, greedy ones never
        spec = runner.spec
        self._whole_prob = {VERIFY_GREEDY: False,
                            VERIFY_SAMPLED: spec is not None and spec.draft_sample_method == "probabilistic"}
        self.target: dict[tuple[int, int], _Captured] = {}
        self.draft: dict[tuple[int, int, bool], _Captured] = {}
        self.verify: dict[tuple[int, int], _Captured] = {}
        self.sample: dict[tuple[int, bool], _Captured] = {}
        self.whole: dict[tuple[int, int, int], _Captured] = {}
        self.pool = None
        # steps replayed; one-sync steps; steps launched on top of another (async), of which with
        # prompts admitted as prefill rows (async_admit); steps with prefill rows (prefill_rows)
        self.stats = {"target": 0, "draft": 0, "verify": 0, "sample": 0, "whole": 0, "one_sync": 0, "async": 0,
                      "async_admit": 0, "prefill_rows": 0}

    def _use_set(self, k: int) -> None:
        self._set = k
        self._pinned = self._pinned_sets[k]
        self._hi, self._hf, self._hb, self._hs, self._ht = self._views[k]

    def flip(self) -> torch.Tensor:
        """Switch to the other set of pinned host buffers (async scheduling: the set of step t - 1,
        whose copies are done since its tokens were read back, or are awaited here if that step was
        dropped: ``hold``) and return that set's token buffer."""
        self._settle(self._set ^ 1)
        self._use_set(self._set ^ 1)
        return self._token_host[self._set]

    def hold(self, done: torch.cuda.Event | None) -> None:
        """The step launched last (its pinned set is the current one) will not be read back: its requests
        ended (LLMEngine drops it). Instead of waiting for it now, the set's next writer waits for
        ``done`` (flip, prepare_target), so that the host's next scheduling and launch overlap it."""
        if done is not None:
            self._held[self._set] = done

    def _settle(self, k: int) -> None:
        done = self._held.pop(k, None)
        if done is not None:
            done.synchronize()

    # ------------------------------------------------------------------ the fixed-shape steps
    def _target_step(self, B: int, bucket: int) -> tuple:
        r = self.runner
        T = B * self.q
        meta = self._meta_cls(
            slot_mapping=self.slot_mapping[:T], block_tables=self.block_tables[:B], seq_lens=self.seq_lens[:B],
            query_start_loc=self.query_start_loc[:B + 1], max_query_len=self.q, max_seq_len=bucket,
        )
        # the taps straight into their buffer (the concatenation's output: no copy after it)
        hidden, _ = r.model(self.input_ids[:T], self.positions[:T], r.backend, meta, r.kv_caches,
                            taps_out=self.taps[:T] if self.taps is not None else None)
        logits = r.model.compute_logits(hidden, out=self.logits[:T])  # [T, V] fp32, every row
        return (logits,)

    def _rows(self, B: int, **changes) -> SamplingBatch:
        """The first B rows of the graphs' sampling settings (``self.sampling``), with ``changes`` (fields
        and flags) applied: each graph that samples fixes its own flags at capture."""
        s = self.sampling
        head = {f.name: getattr(s, f.name)[:B] for f in fields(s) if isinstance(getattr(s, f.name), torch.Tensor)}
        return replace(s, **{**head, **changes})

    def _draft_step(self, B: int, bucket: int, prob: bool) -> tuple:
        p = self.runner.proposer
        T = B * self.q
        p.write_context(self.taps[:T], self.positions[:T], self.slot_mapping[:T], valid=self.valid[:T])
        top_k, top_p, min_p = (t[:B] for t in self._neutral_rows)
        # the drafts' settings are a temperature only (neutral filters): the fused sampler's one-launch slots
        batch = self._rows(B, top_k=top_k, top_p=top_p, min_p=min_p, all_greedy=not prob, no_top_k=True,
                           no_top_p=True, no_min_p=True, max_top_k=0)
        prop = p.propose_fixed(self.anchors[:B], self.anchor_pos[:B], self.block_tables[:B], self.n_spec, batch,
                               self.prob_mask[:B], prob, max_ctx_len=bucket,
                               probs_out=self.probs[:B] if prob else None)
        return (prop.tokens, prop.probs, prop.confidence)

    @staticmethod
    def verify_kind(sampled: bool, filtered: bool) -> int:
        """The verification (VERIFY_*) of a step: greedy rows only, sampled rows at a temperature only,
        or sampled rows with top-k / top-p / min-p."""
        return VERIFY_GREEDY if not sampled else VERIFY_FILTERED if filtered else VERIFY_SAMPLED

    def _verify_kinds(self, B: int) -> list[int]:
        if not self.draft_graphs:
            return [VERIFY_GREEDY]
        return [VERIFY_GREEDY, VERIFY_SAMPLED] + ([VERIFY_FILTERED] if B * self.q <= FILTER_GRAPH_ROWS else [])

    def _verify_step(self, B: int, kind: int) -> tuple:
        """Verification of the drafts in the target step's logits (run after it): the argmax of every
        row and greedy verification of every request; VERIFY_SAMPLED / VERIFY_FILTERED: also the
        verification by rejection_sample_method of every request against its processed distribution
        (temperature; with VERIFY_FILTERED also each row's top-k, top-p and min-p, neutral values doing
        nothing) and the drafts' q at ``q_rows`` of ``probs``, taken for the rows with temperature > 0. The same
        distributions, keys and kernel as ModelRunner._verify (the host path), so the same tokens. Returns
        (tokens [B, q], emitted [B], argmax [B, q])."""
        from dspark.kernels.spec_step import verify_greedy_rows

        q, V = self.q, self.runner.vocab_size
        logits = self.logits[:B * q].view(B, q, V)
        drafts = self.input_ids[:B * q].view(B, q)[:, 1:]
        nd = self.num_drafts[:B]
        outs = (self.v_out[:B], self.v_n[:B], self.v_am[:B])  # straight into the buffers: no copies after
        if kind == VERIFY_GREEDY:
            outs[2].copy_(self.runner.sampler.argmax(logits.reshape(-1, V)).view(B, q))
            verify_greedy_rows(outs[2], drafts, nd, out=outs[0], n_out=outs[1])
            return outs
        s = self._rows(B)
        plain = kind == VERIFY_SAMPLED
        # each request's settings on its q rows (as SamplingBatch.repeat_rows makes them): the temperature uploaded
        # so (row_temperature); VERIFY_SAMPLED's filters are neutral in every row, so they come from constant rows
        # (views: no repeat at replay), VERIFY_FILTERED's are repeated here
        filters = ("top_k", "top_p", "min_p")
        if plain:
            rep = dict(zip(filters, (x[:B * q] for x in self._neutral_rows)))
        else:
            rep = {k: getattr(s, k).repeat_interleave(q) for k in filters}
        rep["temperature"] = self.row_temperature[:B * q]
        r = self.runner
        method = r.spec.rejection_sample_method
        if (plain and VERIFY_FROM_LOGITS and B * q >= VERIFY_FROM_LOGITS_MIN_ROWS and r.verify_from_logits
                and method in r._fused_verify):
            # each row's (t, M, Z) and argmax; the kernel makes every p it reads from the logits
            from dspark.kernels.softmax import temperature_softmax_stats

            stats, _ = temperature_softmax_stats(logits.reshape(-1, V), rep["temperature"],
                                                 argmax_out=outs[2].view(-1))
            o, n = r._verify_probabilistic(method, logits, drafts, self.probs, nd, s.seeds, self.num_tokens[:B],
                                           target_stats=stats.view(B, q, 3), draft_rows=self.q_rows[:B])
        else:
            rows = replace(s, **rep, positions=self.num_tokens[:B], all_random=True, no_top_k=plain,
                           no_top_p=plain, no_min_p=plain)
            # the processed distributions and every row's argmax (greedy rows' verification) in one go
            probs, am = r.sampler.probs_argmax(logits.reshape(-1, V), rows)
            outs[2].copy_(am.view(B, q))
            o, n = r._verify_probabilistic(method, probs.view(B, q, V), drafts, self.probs, nd, s.seeds,
                                           self.num_tokens[:B], draft_rows=self.q_rows[:B])
        # greedy verification of every row; the rows with temperature > 0 take the sampled outcome (o, n)
        verify_greedy_rows(outs[2], drafts, nd, sampled=(s.temperature, o, n), out=outs[0], n_out=outs[1])
        return outs

    def _whole_step(self, B: int, bucket: int, kind: int) -> tuple:
        """A one-sync step without prefill rows in one piece: _target_step, _verify_step, the drafter's inputs
        from its outcome (drafter_inputs_on_device), _draft_step (probabilistic drafts as ``_whole_prob`` says
        for the kind) and the read-back's concatenation into ``flat``. The same kernels on the same buffers as
        the three graphs, in the same order: the same tokens. Returns (tokens [B, q], emitted [B], argmax [B, q],
        drafts [B, N], their q or None, the read-back [B (q + 1 + N)])."""
        self._target_step(B, bucket)
        out, n_out, am = self._verify_step(B, kind)
        self.drafter_inputs_on_device(B, out, n_out)
        tokens, probs, _ = self._draft_step(B, bucket, self._whole_prob[kind])
        flat = self.flat[:B * (self.q + 1 + self.n_spec)]
        torch.cat([out.reshape(-1), n_out, tokens.reshape(-1)], out=flat)
        return out, n_out, am, tokens, probs, flat

    def has_whole(self, Bg: int, bucket: int, kind: int, any_prob: bool) -> bool:
        """Whether replay_whole can run this step: a whole-step graph of (Bg, bucket, kind) (captured, or within
        the sizes and kinds that would be when running eagerly) whose drafting matches ``any_prob``."""
        if not self.whole_max_batch or self._whole_prob.get(kind) is None or self._whole_prob[kind] != any_prob:
            return False
        return (Bg, bucket, kind) in self.whole if self.capture else Bg <= self.whole_max_batch

    def replay_whole(self, Bg: int, bucket: int, kind: int) -> tuple:
        """The whole one-sync step (_whole_step; has_whole must hold): its outputs, the verification's in the
        buffers the three-graph path uses too (replay_verify). Counted as a target, verification and drafter step
        too (``stats``)."""
        for k in ("whole", "target", "verify", "draft"):
            self.stats[k] += 1
        return self._run(self.whole, (Bg, bucket, kind), self._whole_step)

    def _sample_step(self, B: int, filtered: bool) -> tuple:
        """Without speculation (q = 1): the tokens of a launched decode step (ModelRunner.launch: rows
        greedy or sampled, no top-k), drawn exactly as the Sampler draws them (Gumbel-max keyed by (seed,
        position = num_tokens, STREAM_SAMPLE); greedy rows the argmax); ``filtered``: with each row's
        top-p and min-p (a sort of the B rows' vocabularies; neutral values do nothing)."""
        batch = self._rows(B, positions=self.num_tokens[:B], no_top_k=True, no_top_p=not filtered,
                           no_min_p=not filtered, max_top_k=0)
        out = self.s_out[:B]
        out.copy_(self.runner.sampler(self.logits[:B], batch, no_sync=True))
        return (out,)

    def _run(self, table: dict, key: tuple, fn) -> tuple:
        c = table.get(key)
        if c is None:
            if self.capture:
                raise KeyError(f"no CUDA graph captured for {key}")
            c = table[key] = _Captured(None, ())
        if c.graph is None:
            return fn(*key)
        c.graph.replay()
        return c.outputs

    # ------------------------------------------------------------------ capture
    def capture_all(self) -> None:
        """Capture every graph (largest first, so smaller ones reuse the pool's memory), with a
        progress bar and a log line of what was captured and the memory it took."""
        if not self.capture:
            return
        from tqdm import tqdm

        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free0 = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        keys = [("target", (B, k)) for B in reversed(self.batch_sizes) for k in reversed(self.buckets)]
        if self.draft_graphs:
            keys += [("draft", (B, k, prob)) for B in reversed(self.batch_sizes) for k in reversed(self.buckets)
                     for prob in (False, True)]
        if self.q > 1:
            keys += [("verify", (B, kind)) for B in reversed(self.batch_sizes) for kind in self._verify_kinds(B)]
            keys += [("whole", (B, k, kind)) for B in reversed(self.batch_sizes) if B <= self.whole_max_batch
                     for k in reversed(self.buckets) for kind in self._whole_prob]
        else:
            keys += [("sample", (B, filtered)) for B in reversed(self.batch_sizes) for filtered in (False, True)]
        self.pool = torch.cuda.graph_pool_handle()
        self._reset_inputs()
        with torch.inference_mode():
            for kind, key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
                table, fn = {"target": (self.target, self._target_step), "draft": (self.draft, self._draft_step),
                             "verify": (self.verify, self._verify_step),
                             "sample": (self.sample, self._sample_step), "whole": (self.whole, self._whole_step)}[kind]
                fn(*key)  # warm up: Triton compiles, cuBLAS picks its kernels, outside the capture
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = fn(*key)
                table[key] = _Captured(g, out)
        torch.cuda.synchronize(dev)
        used = (free0 - torch.cuda.mem_get_info(dev)[0]) / 2**20
        rest = ("; drafter steps (greedy and probabilistic) at the same sizes" if self.draft_graphs else "") + (
            "; verification (greedy, sampled, filtered up to %d rows) per batch size" % FILTER_GRAPH_ROWS
            if self.q > 1 else "; sampling (temperature; with top-p / min-p) per batch size") + (
            "; whole steps (greedy and sampled) up to batch %d" % self.whole_max_batch if self.whole_max_batch else "")
        logger.info("captured %d CUDA graphs in %.1f s, %.0f MiB: target (q=%d) at batch sizes %s x context "
                    "buckets %s%s", len(keys), time.perf_counter() - t0, used, self.q, self.batch_sizes,
                    self.buckets, rest)

    def profile(self, max_batch: int, reps: int = 3) -> dict[tuple[int, bool], float]:
        """Seconds per verification step (target + verification + drafter graphs, the smallest context
        bucket) at each captured batch size up to the first that holds ``max_batch``, greedy and sampled
        (the sampled verification and the probabilistic drafter graph): the step-time table of adaptive
        verification (spec/adaptive.py). Replays on the capture-time inputs (padding rows on the dummy block), so
        nothing live is touched; call right after capture_all."""
        assert self.capture and self.draft_graphs, "profiling needs captured DSpark graphs"
        k = self.buckets[0]
        out = {}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for B in self.batch_sizes[:next((i + 1 for i, b in enumerate(self.batch_sizes) if b >= max_batch), None)]:
            for sampled in (False, True):
                graphs = (self.target[(B, k)], self.verify[(B, VERIFY_SAMPLED if sampled else VERIFY_GREEDY)],
                          self.draft[(B, k, sampled)])
                for i in range(reps + 1):
                    if i == 1:
                        start.record()
                    for c in graphs:
                        c.graph.replay()
                end.record()
                end.synchronize()
                out[(B, sampled)] = start.elapsed_time(end) / 1e3 / reps
        return out

    def _reset_inputs(self) -> None:
        """Capture-time inputs: every request a padding request on the dummy block, every row greedy."""
        self.ints.zero_()
        self.block_tables.zero_()
        self.seq_lens.fill_(self.q)
        self.flags.zero_()
        self.positions.view(-1, self.q).copy_(torch.arange(self.q, device=self.positions.device))
        if self.draft_graphs:
            self.sampling.top_k.fill_(self.runner.vocab_size)
            self.sampling.top_p.fill_(1.0)

    # ------------------------------------------------------------------ one step
    def _decode_row(self, s) -> bool:
        """A request that decodes / verifies its drafts: one graph row. With drafter graphs, a prompt's
        last token alone (a chunked prompt whose final chunk is one token: the request has no output token
        yet) is a prefill chunk, not a decode row, although its counts look alike: a sampled decode row
        without drafts cannot run one-sync (ModelRunner._one_sync), so such a step went through the host's
        verification path, which at large batch compiled kernel specialisations the capture never met
        (H200, session 34: 2-4 s of Triton compiles inside a batch-128 temperature-1 bench call); as a
        prefill row it draws its first token with the Sampler under the same key, so the tokens are the
        same. (Plain decode graphs, q = 1, sample such a row as any decode row.)"""
        return (s.samples and s.num_tokens == 1 + s.num_spec_tokens and s.num_tokens <= self.q
                and (not self.draft_graphs or s.num_spec_tokens > 0
                     or s.request.num_tokens > s.request.num_prompt_tokens))

    def covers(self, scheduled) -> bool:
        """Whether this step can run as graphs: decode / verification rows only, batch small enough."""
        if len(scheduled) > self.max_batch or not scheduled:
            return False
        return all(self._decode_row(s) for s in scheduled)

    def row_counts(self, scheduled) -> list[int]:
        """Graph rows of each request: 1 for a decode / verification row, ceil(num_tokens / q) for a
        prefill chunk (prefill rows, module docstring)."""
        return self.row_layout(scheduled)[0]

    def row_layout(self, scheduled) -> tuple[list[int], list[bool]]:
        """(row_counts, which requests are prefill chunks), each request looked at once: the runner passes
        it on to prepare_target (a step of 128 requests looked at them three times: ~0.3 ms of host)."""
        q = self.q
        pre = [not self._decode_row(s) for s in scheduled]
        return [-(-s.num_tokens // q) if p else 1 for s, p in zip(scheduled, pre)], pre

    def covers_prefill(self, scheduled) -> bool:
        """Whether this step, which has prefill chunks, fits the graphs as prefill rows: graphs with room
        for them, no drafts outside full decode rows, and every row within the largest graph."""
        if not self.prefill_rows or not scheduled or self.covers(scheduled):
            return False
        if any(not self._decode_row(s) and s.num_spec_tokens for s in scheduled):
            return False
        return sum(self.row_counts(scheduled)) <= self.max_batch

    def run_target(self, scheduled, ids: list[int], starts: list[int], tables: list[list[int]]):
        """Fill the inputs for the scheduled requests (flattened ``ids``, each request's first position
        ``starts[b]`` and block table) and replay. Returns (logits [B_pad, q, V], B_pad, bucket)."""
        Bg, bucket = self.prepare_target(scheduled, ids, starts, tables)
        self.upload(Bg, drafter=False)
        return self.replay_target(Bg, bucket), Bg, bucket

    def run_draft(self, Bg: int, bucket: int, committed: list[int], rows: list[int], anchors: list[int],
                  anchor_pos: list[int], params: list, seeds: list[int], prob: list[bool]):
        """After run_target: store the drafter context of the first ``committed[b]`` rows of each
        request, then draft for the batch rows ``rows`` (their anchors, anchor positions, sampling
        params, int64 seeds and probabilistic flags; no rows: only the context store matters).
        Returns (tokens [len(rows), N], probs [len(rows), N, V] | None)."""
        q, Tm, Bm = self.q, self.max_rows, self.max_batch
        self.prepare_sampling(Bg, rows, params, seeds, prob)
        hb, hi = self._hb, self._hi
        hb[:Bg * q].reshape(Bg, q)[:] = np.arange(q)[None, :] < np.asarray(committed + [0] * (Bg - len(committed)))[:, None]
        a, ap = hi[3 * Tm:3 * Tm + Bg], hi[3 * Tm + Bm:3 * Tm + Bm + Bg]
        a[:] = 0
        ap[:] = 0
        if rows:
            a[rows] = anchors
            ap[rows] = anchor_pos
        self.upload(Bg, target=False)
        tokens, probs = self.replay_draft(Bg, bucket, any(prob))
        if rows == list(range(len(rows))):
            n = len(rows)
            return tokens[:n], (probs[:n].clone() if probs is not None else None)
        di = torch.tensor(rows, device=tokens.device)
        return tokens[di], (probs[di] if probs is not None else None)

    # ------------------------------------------------------------------ the pieces of a step
    def prepare_target(self, scheduled, ids: list[int], starts: list[int], tables: list[list[int]],
                       num_tokens: list[int] | None = None, layout: tuple | None = None) -> tuple[int, int]:
        """Write the target step's inputs into the pinned host buffers; returns (padded batch, bucket).
        ``num_tokens`` (each request's tokens before the step) is needed by ``drafter_inputs_on_device``;
        ``layout``: row_layout(scheduled), when the caller has it."""
        self._settle(self._set)  # a synchronous step after a dropped one writes its set without a flip
        q, bs, Tm, Bm = self.q, self.block_size, self.max_rows, self.max_batch
        B = len(scheduled)
        n = np.fromiter((s.num_tokens for s in scheduled), np.int64, B)
        st = np.asarray(starts, dtype=np.int64)
        prefill = None
        counts, is_prefill = layout or self.row_layout(scheduled)
        if any(is_prefill):
            # prefill rows: request b's chunk becomes counts[b] rows of q tokens (the last one partial)
            rep = np.repeat(np.arange(B), counts)
            k = np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)  # row index within its request
            prefill = np.repeat(is_prefill, counts)
            st = st[rep] + q * k
            n = np.minimum(q, n[rep] - q * k)
            tables = [tables[b] for b in rep]
            if num_tokens is not None:
                num_tokens = [num_tokens[b] for b in rep]
            B = len(rep)
        Bg = _pick(self.batch_sizes, B)
        j = np.arange(q)
        real = np.zeros((Bg, q), dtype=bool)
        real[:B] = j[None, :] < n[:, None]
        h = self._hi
        ids_v = h[:Bg * q].reshape(Bg, q)
        ids_v[:] = 0
        ids_v[real] = ids  # row-major order of the real rows = the flattened ids' order
        pos = h[Tm:Tm + Bg * q].reshape(Bg, q)
        pos[:B] = st[:, None] + j[None, :]  # padding rows follow the real ones
        pos[B:] = j[None, :]
        lens = np.fromiter(map(len, tables), np.int64, len(tables))
        width = min(self.width, max(-(-(int(st.max()) + q) // bs), int(lens.max())))
        tbl = self._ht
        tbl[:Bg, :width] = 0
        # every table's first `width` entries in one masked assignment (row-major order = the tables' order);
        # a loop of per-row slice assignments cost ~0.25 ms at 128 requests (session 25)
        lens = np.minimum(lens, width)
        flat = np.fromiter(chain.from_iterable(t[:width] for t in tables), np.int64, int(lens.sum()))
        tbl[:len(tables), :width][np.arange(width)[None, :] < lens[:, None]] = flat
        blk = np.take_along_axis(tbl[:Bg], np.minimum(pos // bs, width - 1), 1)
        h[2 * Tm:2 * Tm + Bg * q] = np.where(real, blk * bs + pos % bs, 0).reshape(-1)  # padding: dummy slot 0
        self._hs[:B] = st + q
        self._hs[B:Bg] = q
        nd = h[3 * Tm + 4 * Bm:3 * Tm + 4 * Bm + Bg]
        nd[:] = 0
        nd[:B] = n - 1 if prefill is None else np.where(prefill, 0, n - 1)  # prefill rows verify nothing
        if num_tokens is not None:
            nt = h[3 * Tm + 5 * Bm:3 * Tm + 5 * Bm + Bg]
            nt[:] = 1
            nt[:B] = num_tokens
        return Bg, _pick(self.buckets, int(st.max()) + q)

    def prepare_sampling(self, Bg: int, rows: list[int], params: list, seeds: list[int], prob: list[bool]) -> None:
        """Write the sampling inputs (they do not depend on this step's outcome) of the batch rows
        ``rows``: temperature, seed and probabilistic flag for the drafter, and top-k / top-p / min-p
        for verification (_verify_step; the drafter graph drafts without them, sampler.draft_params);
        other rows draft greedily and are never read. Without speculation: the settings _sample_step
        samples with."""
        # The same settings as this pinned set last took (two steps ago, with async scheduling: the usual
        # case while a batch decodes) are still there: nothing else writes these regions. Saves ~20 µs of
        # the host per step, whose work at batch 1 is close to the GPU's step time (session 37).
        last = self._sampling_written[self._set]
        if (last is not None and last[0] == Bg and last[1] == rows and last[3] == seeds and last[4] == prob
                and all(a is b for a, b in zip(last[2], params))):
            return
        self._sampling_written[self._set] = (Bg, list(rows), list(params), list(seeds), list(prob))
        Tm, Bm, V = self.max_rows, self.max_batch, self.runner.vocab_size
        hi, hf, hb = self._hi, self._hf, self._hb
        base = 3 * Tm
        tk, sd = hi[base + 2 * Bm:base + 2 * Bm + Bg], hi[base + 3 * Bm:base + 3 * Bm + Bg]
        temp, tp, mp = (hf[i * Bm:i * Bm + Bg] for i in range(3))
        trow = hf[3 * Bm:3 * Bm + Bg * self.q]
        pm = hb[Tm:Tm + Bg]
        tk[:] = V
        temp[:] = 0.0
        tp[:] = 1.0
        mp[:] = 0.0
        pm[:] = False
        if rows:
            sd[rows] = seeds
            pm[rows] = prob
            vals = np.array([sampling_row(p, V) for p in params], dtype=np.float64)  # [n, 4]
            temp[rows], tk[rows], tp[rows], mp[rows] = vals[:, 0], vals[:, 1], vals[:, 2], vals[:, 3]
        trow[:] = np.repeat(temp, self.q)

    def upload(self, Bg: int, target: bool = True, drafter: bool = True) -> None:
        """Copy the prepared host buffers to the device (asynchronously, from pinned memory; the
        host writes them again only after the step's tokens were read back)."""
        if target and drafter:  # one copy of the packed bytes, up to the batch's last block-table row
            end = self._bt_off + Bg * self._bt_row
            self._dev_bytes[:end].copy_(self._pinned_bytes[self._set][:end], non_blocking=True)
            return
        hi, hf, hb, hs, ht = self._pinned
        cut = 3 * self.max_rows
        if target:
            self.ints[:cut].copy_(hi[:cut], non_blocking=True)
            self.ints[cut + 4 * self.max_batch:].copy_(hi[cut + 4 * self.max_batch:], non_blocking=True)
        else:
            self.ints[cut:].copy_(hi[cut:], non_blocking=True)
        if target:
            self.seq_lens.copy_(hs, non_blocking=True)
            self.block_tables[:Bg].copy_(ht[:Bg], non_blocking=True)
        if drafter:
            self.floats.copy_(hf, non_blocking=True)
            self.flags.copy_(hb, non_blocking=True)

    def replay_target(self, Bg: int, bucket: int) -> torch.Tensor:
        (logits,) = self._run(self.target, (Bg, bucket), self._target_step)
        self.stats["target"] += 1
        return logits.view(Bg, self.q, -1)

    def replay_draft(self, Bg: int, bucket: int, any_prob: bool):
        tokens, probs, _ = self._run(self.draft, (Bg, bucket, any_prob), self._draft_step)
        self.stats["draft"] += 1
        return tokens, probs

    def replay_verify(self, Bg: int, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After replay_target: (tokens [Bg, q], emitted [Bg], argmax [Bg, q]) of _verify_step, in the
        buffers every verification graph shares: a step launched on top of this one reads them
        (rows_from_previous_step) before its own verification rewrites them, in stream order. A filtered
        step above FILTER_GRAPH_ROWS runs the same verification eagerly."""
        self.stats["verify"] += 1
        if kind == VERIFY_FILTERED and Bg * self.q > FILTER_GRAPH_ROWS:  # not captured: the same step, eagerly
            return self._verify_step(Bg, kind)
        return self._run(self.verify, (Bg, kind), self._verify_step)

    def replay_sample(self, Bg: int, filtered: bool) -> torch.Tensor:
        """After replay_target (q = 1): [Bg] tokens of _sample_step, in a buffer its next replay rewrites."""
        (out,) = self._run(self.sample, (Bg, filtered), self._sample_step)
        self.stats["sample"] += 1
        return out

    def write_q_rows(self, rows: list[int], src: list[int]) -> None:
        """Before ``upload``: graph row rows[j]'s drafts have their q at row src[j] of ``probs`` (the drafter
        graph's row of the request, or ``staged`` + j after ``stage_q``), read by the sampled verification graph."""
        off = 3 * self.max_rows + 6 * self.max_batch
        self._hi[off:off + self.max_batch][rows] = src

    def write_prev_rows(self, rows: list[int]) -> torch.Tensor:
        """Before ``upload``: request b's row in the step below is rows[b] (rows_from_previous_step's ``idx``),
        uploaded with the step's other inputs instead of in an index copy of its own. Returns the device view."""
        off = 3 * self.max_rows + 7 * self.max_batch
        self._hi[off:off + len(rows)] = rows
        return self.prev_rows[:len(rows)]

    def stage_q(self, dq: torch.Tensor) -> None:
        """Copy the q [S, >= N, V] of drafts whose q is not in the drafter graph's rows (one-hot q of greedy
        drafts, a kept copy, another graph set's) to rows ``staged`` + j of ``probs`` (write_q_rows names them)."""
        self.probs[self.staged:self.staged + len(dq)].copy_(dq[:, :self.n_spec])

    def bucket_for(self, context: int) -> int | None:
        """The context bucket a step whose longest request reaches ``context`` tokens replays."""
        return _pick(self.buckets, context)

    def rows_from_previous_step(self, B: int, n_out: torch.Tensor, out: torch.Tensor, drafts: torch.Tensor,
                                idx: torch.Tensor | None = None) -> None:
        """Async scheduling with DSpark (ModelRunner.launch_one_sync with ``prev``): after ``upload``, move
        the first B requests' rows by n_out - q (<= 0; n_out of the previous step: the host wrote them for
        the worst case) — positions, seq_lens, tokens before the step — recompute their cache slots from
        the uploaded block tables, and write their input ids: the new anchor (the last token of ``out``,
        the previous step's emitted tokens, that it emitted), then the drafts made from it. ``idx`` [B]:
        each request's row in the previous step's n_out / out / drafts (None: row b). One launch
        (kernels/spec_step.py: shift_rows, whose reference is the torch version)."""
        from dspark.kernels.spec_step import shift_rows

        q = self.q
        shift_rows(self.positions[:B * q], self.slot_mapping[:B * q], self.input_ids[:B * q], self.seq_lens[:B],
                   self.num_tokens[:B], self.block_tables[:B], q, self.block_size, n_out, out, drafts, idx)

    def drafter_inputs_on_device(self, Bg: int, out: torch.Tensor, n_out: torch.Tensor,
                                 commit: torch.Tensor | None = None) -> None:
        """The drafter's step inputs from this step's outcome, without the host: request b emitted
        out[b, :n_out[b]], so its first n_out[b] rows are committed (the anchor row and the accepted
        drafts), the new anchor is its last emitted token, at position num_tokens[b] + n_out[b] - 1.
        ``commit`` [B] (steps with prefill rows): the committed rows where they are not n_out (a prefill
        row commits all its real rows and emits one token, its last row of a sampling chunk, or none).
        One launch (kernels/spec_step.py: drafter_inputs)."""
        from dspark.kernels.spec_step import drafter_inputs

        q = self.q
        drafter_inputs(out, n_out, commit, self.num_tokens[:Bg], self.valid[:Bg * q], self.anchors[:Bg],
                       self.anchor_pos[:Bg], q)

__all__ = ["StepGraphs", "graph_batch_sizes", "context_buckets"]
