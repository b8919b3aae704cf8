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
  all N slots, the confidence head.
- A step qualifies when every scheduled request samples and has no prefill rows (each runs
  1 + its drafts rows), and the batch fits the largest captured size; anything else (prefill chunks,
  mixed batches) runs eagerly, as with ``enforce_eager``.

Padding (the graphs have fixed shapes): a request with q_b < q real rows gets q − q_b extra rows
after its real ones, at positions after its own; its seq_len grows by as many, so its real rows keep
their positions (the kernels derive a row's position from seq_len) and see nothing new (causal).
Padding requests (b ≥ the real batch) decode q rows at positions 0..q−1 of the dummy block 0.
Every padding row writes its K/V to slot 0 of the dummy block (kv_cache.py: never live), so nothing
live is ever touched; its outputs are never read.

Context buckets (seed 000): the paged-attention kernels read each request's seq_len at run time, so
a graph's loop bounds already follow the real context; what capture fixes is the split of the key
range over programs (flash-decoding), sized by the longest context the graph expects. So each
graph is captured for a bucket of the batch's longest context (powers of two from 512, up to
max_model_len) and the smallest bucket that covers the batch is replayed: a 1k-context step under
max_model_len 8192 does the work of the 1k graph, not the 8k one.

Inputs live in fixed device buffers written before each replay (one host->device copy of the packed
integer inputs, one of the block tables); outputs live in each graph's own tensors, kept alive so the
shared memory pool never hands them out. ``capture=False`` runs the very same padded, fixed-shape
step eagerly: on a CPU (Triton's interpreter) the tests check all the padding logic that way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from dspark.sample.sampler import SamplingBatch
from dspark.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
SMALLEST_BUCKET = 512
_GREEDY = SamplingParams(temperature=0.0)


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
                 buckets: list[int] | None = None) -> None:
        from dspark.layers.triton_attention import TritonAttentionBackend, TritonAttentionMetadata
        from dspark.spec.proposer import DSparkProposer

        if not isinstance(runner.backend, TritonAttentionBackend):
            raise ValueError("CUDA graphs need the triton attention backend")
        self._meta_cls = TritonAttentionMetadata
        self.runner = runner
        self.capture = capture
        cfg = runner.config
        self.block_size = bs = cfg.block_size
        self.n_spec = runner.num_spec_tokens
        self.q = q = 1 + self.n_spec
        self.batch_sizes = batch_sizes or graph_batch_sizes(cfg.max_num_seqs)
        max_len = cfg.max_model_len + q  # a padded request's seq_len reaches max_model_len + q - 1
        self.buckets = buckets or context_buckets(max_len)
        prop = runner.proposer
        self.draft_graphs = isinstance(prop, DSparkProposer) and prop.use_triton and self.n_spec > 0
        dev = runner.device
        Bm = max(self.batch_sizes)
        Tm = Bm * q
        self.max_batch = Bm
        self.width = -(-max_len // bs)
        i64 = dict(dtype=torch.int64, device=dev)
        # Packed integer inputs: [input ids (Tm) | positions (Tm) | slots (Tm) | anchors (Bm) | anchor pos (Bm)]
        self.ints = torch.zeros(3 * Tm + 2 * Bm, **i64)
        self.input_ids = self.ints[:Tm]
        self.positions = self.ints[Tm:2 * Tm]
        self.slot_mapping = self.ints[2 * Tm:3 * Tm]
        self.anchors = self.ints[3 * Tm:3 * Tm + Bm]
        self.anchor_pos = self.ints[3 * Tm + Bm:]
        self.seq_lens = torch.zeros(Bm, dtype=torch.int32, device=dev)
        self.query_start_loc = (torch.arange(Bm + 1, dtype=torch.int32) * q).to(dev)
        self.block_tables = torch.zeros(Bm, self.width, **i64)
        self.valid = torch.zeros(Tm, dtype=torch.bool, device=dev)
        pin = dev.type == "cuda"
        self._h_ints = torch.zeros(self.ints.shape, dtype=torch.int64, pin_memory=pin)
        self._h_seq = torch.zeros(Bm, dtype=torch.int32, pin_memory=pin)
        self._h_valid = torch.zeros(Tm, dtype=torch.bool, pin_memory=pin)
        self.taps = None
        if runner.proposer is not None and runner.model.tap_layers:
            mc = runner.model_config
            self.taps = torch.zeros(Tm, len(runner.model.tap_layers) * mc.hidden_size, dtype=cfg.dtype, device=dev)
        if self.draft_graphs:
            V = runner.vocab_size
            f32 = dict(dtype=torch.float32, device=dev)
            self.sampling = SamplingBatch(
                temperature=torch.zeros(Bm, **f32), top_k=torch.full((Bm,), V, **i64),
                top_p=torch.ones(Bm, **f32), min_p=torch.zeros(Bm, **f32), seeds=torch.zeros(Bm, **i64),
                positions=torch.zeros(Bm, **i64), repetition_penalty=torch.ones(Bm, **f32),
                frequency_penalty=torch.zeros(Bm, **f32), presence_penalty=torch.zeros(Bm, **f32),
                all_greedy=False, all_random=False, no_top_k=False, no_top_p=False, no_min_p=False,
                no_penalties=True, max_top_k=V,
            )
            self.prob_mask = torch.zeros(Bm, dtype=torch.bool, device=dev)
        self.target: dict[tuple[int, int], _Captured] = {}
        self.draft: dict[tuple[int, int, bool], _Captured] = {}
        self.pool = None
        self.stats = {"target": 0, "draft": 0}

    # ------------------------------------------------------------------ the fixed-shape steps
    def _target_step(self, B: int, bucket: int) -> tuple:
        r = self.runner
        T = B * self.q
        meta = self._meta_cls(
            slot_mapping=self.slot_mapping[:T], block_tables=self.block_tables[:B], seq_lens=self.seq_lens[:B],
            query_start_loc=self.query_start_loc[:B + 1], max_query_len=self.q, max_seq_len=bucket,
        )
        hidden, taps = r.model(self.input_ids[:T], self.positions[:T], r.backend, meta, r.kv_caches)
        logits = r.model.compute_logits(hidden)  # [T, V] fp32, every row
        if taps is not None and self.taps is not None:
            self.taps[:T].copy_(taps)
        return (logits,)

    def _draft_step(self, B: int, bucket: int, prob: bool) -> tuple:
        p = self.runner.proposer
        T = B * self.q
        p.write_context(self.taps[:T], self.positions[:T], self.slot_mapping[:T], valid=self.valid[:T])
        s = self.sampling
        batch = SamplingBatch(
            temperature=s.temperature[:B], top_k=s.top_k[:B], top_p=s.top_p[:B], min_p=s.min_p[:B],
            seeds=s.seeds[:B], positions=s.positions[:B], repetition_penalty=s.repetition_penalty[:B],
            frequency_penalty=s.frequency_penalty[:B], presence_penalty=s.presence_penalty[:B],
            all_greedy=not prob, all_random=False, no_top_k=False, no_top_p=False, no_min_p=False,
            no_penalties=True, max_top_k=s.max_top_k,
        )
        prop = p.propose_fixed(self.anchors[:B], self.anchor_pos[:B], self.block_tables[:B], self.n_spec, batch,
                               self.prob_mask[:B], prob, max_ctx_len=bucket)
        return (prop.tokens, prop.probs, prop.confidence)

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
        self.pool = torch.cuda.graph_pool_handle()
        self._reset_inputs()
        with torch.inference_mode():
            for kind, key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
                table, fn = (self.target, self._target_step) if kind == "target" else (self.draft, self._draft_step)
                fn(*key)  # warm up: Triton compiles, cuBLAS picks its kernels, outside the capture
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = fn(*key)
                table[key] = _Captured(g, out)
        torch.cuda.synchronize(dev)
        used = (free0 - torch.cuda.mem_get_info(dev)[0]) / 2**20
        logger.info("captured %d CUDA graphs in %.1f s, %.0f MiB: target (q=%d) at batch sizes %s x context "
                    "buckets %s%s", len(keys), time.perf_counter() - t0, used, self.q, self.batch_sizes,
                    self.buckets, "; drafter steps (greedy and probabilistic) at the same sizes"
                    if self.draft_graphs else "")

    def _reset_inputs(self) -> None:
        """Capture-time inputs: every request a padding request on the dummy block."""
        self.ints.zero_()
        self.block_tables.zero_()
        self.seq_lens.fill_(self.q)
        self.valid.zero_()
        self.positions.view(-1, self.q).copy_(torch.arange(self.q, device=self.positions.device))

    # ------------------------------------------------------------------ one step
    def covers(self, scheduled) -> bool:
        """Whether this step can run as graphs: decode / verification rows only, batch small enough."""
        if len(scheduled) > self.max_batch or not scheduled:
            return False
        for s in scheduled:
            if not s.samples or s.num_tokens != 1 + s.num_spec_tokens or s.num_tokens > self.q:
                return False
        return True

    def run_target(self, scheduled, ids: list[int], starts: list[int], tables: list[list[int]]):
        """Fill the inputs for the scheduled requests (flattened ``ids``, each request's first position
        ``starts[b]`` and block table) and replay. Returns (logits [B_pad, q, V], B_pad, bucket)."""
        q, bs = self.q, self.block_size
        B = len(scheduled)
        Bg = _pick(self.batch_sizes, B)
        Tm = self.input_ids.shape[0]
        h = self._h_ints
        flat: list[int] = []
        at = 0
        for s in scheduled:
            n = s.num_tokens
            flat += ids[at:at + n]
            flat += [0] * (q - n)
            at += n
        h[:Bg * q] = torch.tensor(flat + [0] * ((Bg - B) * q))
        width = min(self.width, max(max(-(-(st + q) // bs) for st in starts), max(len(t) for t in tables)))
        table = torch.tensor([t[:width] + [0] * (width - len(t)) for t in tables] + [[0] * width] * (Bg - B))
        st_t = torch.tensor(starts + [0] * (Bg - B))
        n_t = torch.tensor([s.num_tokens for s in scheduled] + [0] * (Bg - B))
        pos = st_t[:, None] + torch.arange(q)[None, :]  # [Bg, q]; padding rows follow the real ones
        blk = table.gather(1, (pos // bs).clamp(max=width - 1))
        slots = torch.where(torch.arange(q)[None, :] < n_t[:, None], blk * bs + pos % bs, 0)  # padding: slot 0
        h[Tm:Tm + Bg * q] = pos.view(-1)
        h[2 * Tm:2 * Tm + Bg * q] = slots.view(-1)
        self._h_seq[:Bg] = st_t + q
        longest = max(starts) + q
        bucket = _pick(self.buckets, longest)
        self.ints.copy_(h, non_blocking=True)
        self.seq_lens.copy_(self._h_seq, non_blocking=True)
        self.block_tables[:Bg, :width].copy_(table, non_blocking=False)
        (logits,) = self._run(self.target, (Bg, bucket), self._target_step)
        self.stats["target"] += 1
        return logits.view(Bg, q, -1), Bg, bucket

    def run_draft(self, Bg: int, bucket: int, committed: list[int], rows: list[int],
                  anchors: list[int], anchor_pos: list[int], batch: SamplingBatch | None, prob: list[bool]):
        """After run_target: store the drafter context of the first ``committed[b]`` rows of each
        request, then draft for the batch rows ``rows`` (anchors, anchor positions, their SamplingBatch
        and probabilistic flags; none: the context store alone matters). Returns (tokens [len(rows), N],
        probs [len(rows), N, V] | None)."""
        q = self.q
        Tm = self.input_ids.shape[0]
        v = self._h_valid.view(-1, q)
        v[:Bg] = False
        for b, c in enumerate(committed):
            v[b, :c] = True
        h = self._h_ints
        a = h[3 * Tm:3 * Tm + self.max_batch]
        ap = h[3 * Tm + self.max_batch:]
        a[:Bg] = 0
        ap[:Bg] = 0
        idx = torch.tensor(rows, dtype=torch.int64)
        a[idx] = torch.tensor(anchors, dtype=torch.int64)
        ap[idx] = torch.tensor(anchor_pos, dtype=torch.int64)
        self.ints[3 * Tm:].copy_(h[3 * Tm:], non_blocking=True)
        self.valid.copy_(self._h_valid, non_blocking=True)
        s = self.sampling
        s.temperature[:Bg].zero_()  # rows that do not draft: greedy, never read
        s.top_k[:Bg].fill_(self.runner.vocab_size)
        s.top_p[:Bg].fill_(1.0)
        s.min_p[:Bg].zero_()
        self.prob_mask[:Bg].zero_()
        di = idx.to(self.ints.device)
        if rows:
            s.temperature.index_copy_(0, di, batch.temperature)
            s.top_k.index_copy_(0, di, batch.top_k)
            s.top_p.index_copy_(0, di, batch.top_p)
            s.min_p.index_copy_(0, di, batch.min_p)
            s.seeds.index_copy_(0, di, batch.seeds)
        any_prob = any(prob)
        if any_prob:
            self.prob_mask.index_copy_(0, di, torch.tensor(prob).to(di.device))
        tokens, probs, _ = self._run(self.draft, (Bg, bucket, any_prob), self._draft_step)
        self.stats["draft"] += 1
        return tokens[di], (probs[di] if probs is not None else None)


__all__ = ["StepGraphs", "graph_batch_sizes", "context_buckets"]
