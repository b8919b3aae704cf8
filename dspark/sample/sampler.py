"""Turning next-token logits into tokens: penalties, temperature, min-p/top-k/top-p, seeded sampling.

Processing order follows vLLM: penalties -> (greedy rows: argmax here) -> temperature -> min-p ->
top-k -> top-p. Random rows are sampled by Gumbel-max with counter-based noise (dspark.sample.rng),
so each draw is a pure function of (seed, position, stream) and a seeded request gives the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.sample.rng import STREAM_SAMPLE, gumbel, gumbel_at
from dspark.sampling_params import SamplingParams

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def as_int64(seed: int) -> int:
    """Reinterpret any Python int as the signed int64 with the same low 64 bits (what a tensor can hold)."""
    s = seed % _U64
    return s - _U64 if s > _I64_MAX else s


def sampling_row(p: SamplingParams, vocab_size: int) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) of one row as SamplingBatch holds them: greedy rows get the
    neutral top-k/top-p/min-p (filtering cannot change an argmax), a disabled top-k is vocab_size."""
    if p.greedy:
        return p.temperature, vocab_size, 1.0, 0.0
    return p.temperature, vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size), p.top_p, p.min_p


def unfiltered(p: SamplingParams, vocab_size: int) -> bool:
    """Whether a request samples from its whole temperature-scaled distribution: no top-k, top-p or
    min-p (what the engine's sampling and verification graphs take)."""
    return sampling_row(p, vocab_size)[1:] == (vocab_size, 1.0, 0.0)


def draft_params(p: SamplingParams) -> SamplingParams:
    """The settings DSpark drafts a request's tokens with: its temperature, seed and penalties, without
    its top-k, top-p and min-p. Verification checks the drafts against the request's own distribution
    (filters included) with q = the distribution they were drawn from, which keeps the output exact for
    any q (standard and block verification alike); only acceptance depends on q. Why: in the fused
    Markov sampler a top-p (or a top-k above the number of vocabulary tiles) cut of a flat distribution
    falls back to a bisection over the row, one pass per step in one program per row: on the H200 the
    drafter step at T = 1, top-p 0.9 took 2.8 ms at B = 1 against 0.2 ms without (session 22), which made
    DSpark 0.3-0.6x plain decoding."""
    if p.top_k in (-1, 0) and p.top_p == 1.0 and p.min_p == 0.0:
        return p
    return replace(p, top_k=-1, top_p=1.0, min_p=0.0)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class SamplingBatch:
    """Per-row sampling settings of B rows as tensors on one device, plus Python fast-path flags.

    Greedy rows (temperature 0) get neutral top-k/top-p/min-p values, since filtering cannot change
    an argmax; the flags therefore describe only the random rows. Penalties apply to all rows.
    """

    temperature: Tensor  # [B] f32; 0 = greedy
    top_k: Tensor  # [B] int64; vocab_size = disabled
    top_p: Tensor  # [B] f32; 1 = disabled
    min_p: Tensor  # [B] f32; 0 = disabled
    seeds: Tensor  # [B] int64; the request seed's low 64 bits
    positions: Tensor  # [B] int64; absolute position of the token being sampled
    repetition_penalty: Tensor  # [B] f32; 1 = disabled
    frequency_penalty: Tensor  # [B] f32; 0 = disabled
    presence_penalty: Tensor  # [B] f32; 0 = disabled
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    max_top_k: int  # largest enabled top_k (0 if none): top-k without top-p needs only this many values
    prompt_counts: Tensor | None = None  # [B, V] int32 token counts in the prompt; only with a repetition penalty
    output_counts: Tensor | None = None  # [B, V] int32 token counts in the output; only with any penalty

    def repeat_rows(self, k: int) -> SamplingBatch:
        """Each row k times in a row, the copies at positions p, p + 1, ..., p + k - 1 (the N + 1 rows a
        verification step decides per request), without going back to the host."""
        out = replace(self, **{f.name: getattr(self, f.name).repeat_interleave(k, dim=0) for f in fields(self)
                               if isinstance(getattr(self, f.name), Tensor)})
        steps = torch.arange(k, device=self.positions.device).repeat(self.positions.shape[0])
        out.positions = out.positions + steps
        return out

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather B requests' settings into tensors with two host-to-device copies.

        This runs every decode step, so token lists are only read (and counts only built) when some
        row has a penalty, and then only for those rows.
        """
        floats: list[list[float]] = [[], [], [], [], [], []]
        top_k: list[int] = []
        max_top_k = 0
        any_greedy = any_random = any_top_p = any_min_p = any_penalty = any_repetition = False
        for p in params:
            greedy = p.greedy
            any_greedy |= greedy
            any_random |= not greedy
            _, k, top_p, min_p = sampling_row(p, vocab_size)
            if k < vocab_size:
                max_top_k = max(max_top_k, k)
            any_top_p |= top_p < 1.0
            any_min_p |= min_p > 0.0
            any_penalty |= _has_penalty(p)
            any_repetition |= p.repetition_penalty != 1.0
            top_k.append(k)
            for column, value in zip(
                floats,
                (p.temperature, top_p, min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty),
            ):
                column.append(value)

        # Pinned and non-blocking on CUDA: a blocking copy from pageable memory waits for the whole stream,
        # which would stall the host behind the step in flight (async scheduling) or the graph just queued.
        pin = torch.device(device).type == "cuda"
        float_rows = torch.tensor(floats, dtype=torch.float32, pin_memory=pin).to(device, non_blocking=pin)  # [6, B]
        int_rows = torch.tensor(
            [top_k, [as_int64(s) for s in seeds], positions], dtype=torch.int64, pin_memory=pin
        ).to(device, non_blocking=pin)  # [3, B]
        temperature, top_p_t, min_p_t, repetition, frequency, presence = float_rows.unbind(0)
        top_k_t, seeds_t, positions_t = int_rows.unbind(0)

        prompt_counts = output_counts = None
        if any_penalty:
            rows = [i for i, p in enumerate(params) if _has_penalty(p)]
            output_counts = _token_counts([output_ids[i] for i in rows], rows, len(params), vocab_size, device)
            if any_repetition:
                prompt_counts = _token_counts([prompt_ids[i] for i in rows], rows, len(params), vocab_size, device)

        return cls(
            temperature=temperature,
            top_k=top_k_t,
            top_p=top_p_t,
            min_p=min_p_t,
            seeds=seeds_t,
            positions=positions_t,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
            all_greedy=not any_random,
            all_random=not any_greedy,
            no_top_k=max_top_k == 0,
            no_top_p=not any_top_p,
            no_min_p=not any_min_p,
            no_penalties=not any_penalty,
            max_top_k=max_top_k,
            prompt_counts=prompt_counts,
            output_counts=output_counts,
        )


def _token_counts(
    token_lists: list[list[int]], rows: list[int], batch_size: int, vocab_size: int, device: torch.device | str
) -> Tensor:
    """[batch_size, vocab_size] int32 counts of each token of token_lists[i] in row rows[i] (other rows 0)."""
    counts = torch.zeros(batch_size, vocab_size, dtype=torch.int32, device=device)
    lengths = [len(t) for t in token_lists]
    total = sum(lengths)
    if total == 0:
        return counts
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64).to(device)  # [total]
    row_of = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.int64).to(device),
        torch.tensor(lengths, dtype=torch.int64).to(device),
        output_size=total,  # known on the host: avoids a device sync
    )  # [total]
    counts.index_put_((row_of, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
    return counts


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, frequency and presence penalties on [B, V] f32 logits; returns a new tensor (or `logits`).

    Repetition (HF/vLLM): for tokens seen in prompt or output, positive logits are divided by the
    penalty and negative ones multiplied. Frequency/presence (OpenAI/vLLM): subtract
    frequency * (count in output) and presence * (1 if in output).
    """
    if batch.no_penalties:
        return logits
    assert batch.output_counts is not None
    output_counts = batch.output_counts.to(logits.dtype)  # [B, V]
    if batch.prompt_counts is not None:
        seen = (batch.prompt_counts > 0) | (batch.output_counts > 0)  # [B, V]
        rp = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    return (
        logits
        - batch.frequency_penalty.unsqueeze(1) * output_counts
        - batch.presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    )


def apply_temperature(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Divide [B, V] logits by each row's temperature; greedy rows (temperature 0) are left as they are."""
    t = batch.temperature
    return logits / torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1)


def apply_top_k_top_p_min_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Mask [B, V] temperature-scaled logits with -inf outside each row's min-p, top-k and top-p sets.

    Applied in vLLM's order, each on the distribution left by the previous one:
    min-p drops tokens with prob < min_p * max_prob; top-k keeps tokens whose logit is >= the k-th
    largest (ties at the boundary kept); top-p keeps the smallest highest-probability set whose
    cumulative probability reaches top_p (the top token always). Returns a new tensor (or `logits`).
    """
    if not batch.no_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf masks nothing.
        threshold = logits.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1)  # [B, 1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    if batch.no_top_k and batch.no_top_p:
        return logits

    vocab = logits.shape[-1]
    k_enabled = (batch.top_k < vocab).unsqueeze(1)  # [B, 1]
    if batch.no_top_p:
        # Only the max_top_k largest values are needed, far cheaper than sorting the vocabulary.
        top = logits.topk(batch.max_top_k, dim=-1).values  # [B, max_top_k], descending
        kth = top.gather(1, (batch.top_k.clamp(max=batch.max_top_k) - 1).unsqueeze(1))  # [B, 1]
        return logits.masked_fill(k_enabled & (logits < kth), -math.inf)

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each
    if not batch.no_top_k:
        kth = sorted_logits.gather(1, (batch.top_k.clamp(max=vocab) - 1).unsqueeze(1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(k_enabled & (sorted_logits < kth), -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]: probability of strictly higher-ranked tokens
    top_p = batch.top_p.unsqueeze(1)  # [B, 1]
    # top_p == 1 rows are skipped outright: rounding could push mass_before of the tail up to 1.
    drop_sorted = (mass_before >= top_p) & (top_p < 1.0)  # [B, V]
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # back to vocabulary order
    return sorted_logits.scatter(1, order, sorted_logits).masked_fill(drop, -math.inf)


def _process(penalised: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] logits random rows sample from: temperature-scaled, then min-p/top-k/top-p filtered."""
    return apply_top_k_top_p_min_p(apply_temperature(penalised, batch), batch)


def compute_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] f32 distribution each row is actually sampled from, given raw [B, V] logits.

    Random rows: softmax of the penalised, temperature-scaled, filtered logits. Greedy rows: one-hot
    of the penalised argmax. Speculative decoding uses this as the target/draft distribution.
    """
    penalised = apply_penalties(logits.float(), batch)
    if batch.all_greedy:
        return F.one_hot(penalised.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    probs = _process(penalised, batch).softmax(dim=-1)  # [B, V]
    if batch.all_random:
        return probs
    one_hot = F.one_hot(penalised.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)  # [B, V]
    return torch.where((batch.temperature == 0).unsqueeze(1), one_hot, probs)


# Sampler(fused=True).probs for rows at a temperature only (no filter, no penalty) through kernels/softmax.py;
# off (DSPARK_FUSED_PLAIN_PROBS=0) for the A/B against torch's division + softmax + argmax.
FUSED_PLAIN_PROBS = os.environ.get("DSPARK_FUSED_PLAIN_PROBS", "1") != "0"
# Sampler(fused=True)'s draw and argmax for such rows (and greedy rows) through kernels/softmax.py's
# temperature_sample; off (DSPARK_FUSED_PLAIN_SAMPLE=0) for the A/B against torch's Gumbel-max passes.
FUSED_PLAIN_SAMPLE = os.environ.get("DSPARK_FUSED_PLAIN_SAMPLE", "1") != "0"

CANDIDATE_LIMIT = 1024  # random rows with top_k <= this sample from their top_k candidates only


def sample_from_candidates(penalised: Tensor, batch: SamplingBatch, stream: int) -> tuple[Tensor, Tensor] | None:
    """Gumbel-max over each row's top-k candidates only: ([B] tokens, [B] bool rows served), or None
    when no row can be. A row is served when it samples (temperature > 0), has a top_k <= CANDIDATE_LIMIT
    and no tie at its k-th value reaches past the candidates (the full path keeps every tied token).
    Whether a row is served depends on that row alone, never on the rest of the batch.

    The same draw as the full path: filtered-out tokens have logit -inf there and can never win the
    argmax, and the candidates get the same counter-based noise (``gumbel_at``). The only difference
    is the order of floating-point sums inside top-p's softmax/cumsum (over k values instead of the
    whole vocabulary), which can move a cumulative mass by a rounding step. It turns a full sort and
    [B, V] noise into topk(k + 1) and [B, k] noise.
    """
    V = penalised.shape[-1]
    K = min(batch.max_top_k, CANDIDATE_LIMIT)
    if K == 0 or K >= V:
        return None
    # Candidates from the raw logits, scaled afterwards: dividing by a positive temperature keeps the
    # order (ties it creates among the K + 1 values are seen below exactly as the full path sees them).
    vals, idx = penalised.topk(K + 1, dim=-1)  # [B, K + 1], descending
    t = batch.temperature
    vals = vals / torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1)
    k_rows = batch.top_k.clamp(max=K)
    kth = vals.gather(1, (k_rows - 1).unsqueeze(1))  # [B, 1]
    served = (t > 0) & (batch.top_k <= K) & (vals[:, K] != kth[:, 0])
    vals, idx = vals[:, :K], idx[:, :K]
    keep = vals >= kth
    if not batch.no_min_p:
        keep &= vals >= vals[:, :1] + batch.min_p.log().unsqueeze(1)
    vals = vals.masked_fill(~keep, -math.inf)
    if not batch.no_top_p:
        probs = vals.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = batch.top_p.unsqueeze(1)
        vals = vals.masked_fill((mass_before >= top_p) & (top_p < 1.0), -math.inf)
    pick = (vals + gumbel_at(batch.seeds, batch.positions, stream, idx)).argmax(dim=-1, keepdim=True)
    return idx.gather(1, pick).squeeze(1), served


class Sampler:
    """Picks one token per row from raw [B, V] logits according to a SamplingBatch.

    ``fused``: on a GPU, rows with top-k / top-p go through the fused Triton sampler
    (dspark.kernels.markov_sampler.sample_rows / processed_probs: the cut found as one threshold, no sort
    of the vocabulary, two launches and a radix select for top-p) instead of the PyTorch ops below; the same draw but for exact ties
    at the top-p cut and the rounding of the sums behind a top-p decision (that module's docstring).
    """

    def __init__(self, fused: bool = False) -> None:
        self.fused = fused

    def _use_fused(self, logits: Tensor, batch: SamplingBatch) -> bool:
        return self.fused and logits.is_cuda and not batch.all_greedy and not (batch.no_top_k and batch.no_top_p)

    def _plain_rows(self, logits: Tensor, batch: SamplingBatch) -> bool:
        """Rows at a temperature only (no filter, no penalty): kernels/softmax.py's two launches in place of
        torch's division, softmax and (probs_argmax) argmax. FUSED_PLAIN_PROBS=False: torch's."""
        return (self.fused and FUSED_PLAIN_PROBS and logits.is_cuda and not batch.all_greedy and batch.no_top_k
                and batch.no_top_p and batch.no_min_p and batch.no_penalties)

    def _sample_kernel(self, logits: Tensor, batch: SamplingBatch | None) -> bool:
        """Rows greedy or at a temperature only (no filter, no penalty; ``batch`` None: all greedy) drawn by
        kernels/softmax.py's temperature_sample. FUSED_PLAIN_SAMPLE=False: torch's ops."""
        return (self.fused and FUSED_PLAIN_SAMPLE and logits.is_cuda
                and (batch is None or (batch.no_top_k and batch.no_top_p and batch.no_min_p and batch.no_penalties)))

    def argmax(self, logits: Tensor) -> Tensor:
        """[R] int64 first argmax of [R, V] logits (greedy rows' tokens, greedy verification's rows)."""
        if self._sample_kernel(logits, None) and logits.dim() == 2:
            from dspark.kernels.softmax import temperature_sample

            return temperature_sample(logits, None)
        return logits.argmax(dim=-1)

    def probs(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """``compute_probs(logits, batch)`` ([B, V] f32), fused where ``fused`` says."""
        if self._plain_rows(logits, batch):
            return self.probs_argmax(logits, batch)[0]
        if self._use_fused(logits, batch):
            from dspark.kernels.markov_sampler import processed_probs

            return processed_probs(logits, batch)
        return compute_probs(logits, batch)

    def probs_argmax(self, logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor]:
        """(``probs(logits, batch)``, ``logits.argmax(-1)``): a sampled batch's verification needs both; for
        rows at a temperature only they come from the same two passes over the logits."""
        if self._plain_rows(logits, batch):
            from dspark.kernels.softmax import temperature_softmax_argmax

            return temperature_softmax_argmax(logits, batch.temperature, one_hot_greedy=not batch.all_random)
        return self.probs(logits, batch), logits.argmax(dim=-1)

    def __call__(self, logits: Tensor, batch: SamplingBatch, stream: int = STREAM_SAMPLE,
                 no_sync: bool = False) -> Tensor:
        """[B] int64 tokens. Greedy rows: argmax of the penalised logits. Random rows: Gumbel-max,
        argmax(processed logits + gumbel(seed, position, stream)), an exact draw from softmax of the
        processed logits that depends only on (seed, position, stream). ``no_sync``: never read a
        device value on the host (async scheduling): the whole-vocabulary draw is made even when
        every row was served by its candidates (the same tokens, more GPU work)."""
        if self._sample_kernel(logits, batch):
            from dspark.kernels.softmax import temperature_sample

            return temperature_sample(logits, None if batch.all_greedy else batch.temperature, batch.seeds,
                                      batch.positions, stream)
        if self._use_fused(logits, batch) and not batch.no_top_p:  # top-k alone: the candidates below
            from dspark.kernels.markov_sampler import sample_rows

            return sample_rows(logits, batch, stream)
        penalised = apply_penalties(logits.float(), batch)
        if batch.all_greedy:
            return penalised.argmax(dim=-1)
        cand = sample_from_candidates(penalised, batch, stream)
        if cand is not None and not no_sync and bool((cand[1] | (batch.temperature == 0)).all()):
            sampled = cand[0]  # every random row drawn from its candidates
        else:  # the rest (no top-k, a tie past the candidates) from the whole vocabulary
            noise = gumbel(batch.seeds, batch.positions, stream, logits.shape[-1])  # [B, V]
            sampled = (_process(penalised, batch) + noise).argmax(dim=-1)  # [B]
            if cand is not None:
                sampled = torch.where(cand[1], cand[0], sampled)
        if batch.all_random:
            return sampled
        return torch.where(batch.temperature == 0, penalised.argmax(dim=-1), sampled)

    def logprobs(self, logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probabilities from log_softmax of the raw [B, V] logits (vLLM's default "raw logprobs").

        Returns (sampled_logprob [B] f32 of `tokens` [B], topk_ids [B, k] int64, topk_logprobs [B, k] f32).
        """
        logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
        sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
        top = logprobs.topk(k, dim=-1)
        return sampled, top.indices, top.values
