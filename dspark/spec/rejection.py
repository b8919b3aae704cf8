"""Speculative verification: accept a prefix of the drafts and emit one more token, losslessly.

One verify step of one request: the target ran on the anchor plus N drafts X_1..X_N and produced
N+1 next-token distributions; row i (0-based) of `target_*` is the target's prediction for the token
after draft i (row 0: after the anchor), i.e. p_{i+1} in the 1-based notation below. Draft i
(1-based) sits at absolute position `positions + i - 1`. Every function here emits the accepted
drafts followed by exactly one target token (recovered or bonus), so `num_emitted = accepted + 1`,
and works on a whole batch whose requests have different draft counts N_b = num_drafts[b] <= N
(rows padded to N): no Python loop over the batch or the vocabulary, no host sync, results returned
as device tensors.

Randomness (dspark.sample.rng) is a pure function of (seed, position, stream), so a request gives the
same result whatever else shares its batch and wherever its row is:

  * acceptance uniforms: U_i = uniform(seed, positions, accept_stream, N)[i - 1], i.e. keyed by the
    position of the step's FIRST draft with the draft index as the column (see `_acceptance_uniforms`
    for why not by the position of draft i);
  * recovered / bonus token: Gumbel-max with gumbel(seed, positions + accepted, recover_stream, V),
    keyed by the absolute position the token is emitted at.

The draft noise must come from yet another stream (STREAM_DRAFT); sharing a stream with the
acceptance uniforms biases the output (vLLM shipped that bug). Across steps: token-wise verification
only consults randomness at positions <= the emitted token, so draft noise keyed by draft position is
fine for it; block verification also inspects drafts and uniforms past τ, and the next step starts at
positions + τ + 1, so the drafter feeding it must key its noise per step too, or the output is biased
(tests/spec/test_rejection.py::test_block_consecutive_steps_need_per_step_keys). DSparkProposer does:
gumbel(seed, position of the step's first draft, draft_stream(slot)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark.sample.rng import STREAM_ACCEPT, STREAM_RECOVER, gumbel, uniform

__all__ = ["verify_greedy", "verify_probabilistic", "METHODS"]

METHODS = ("standard", "block")

_TINY = torch.finfo(torch.float32).tiny  # smallest normal f32: guards q(x) = 0 in p(x) / q(x)


# --------------------------------------------------------------------------------------------- helpers


def _draft_mask(num_drafts: Tensor, n: int) -> Tensor:
    """[B, n] bool: column i (0-based) holds a real draft of row b, i.e. i < num_drafts[b]."""
    return torch.arange(n, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)


def _emit(draft_tokens: Tensor, num_accepted: Tensor, final_token: Tensor) -> tuple[Tensor, Tensor]:
    """Assemble the output rows: X_1..X_a, then the final token at column a, then -1 padding.

    draft_tokens: [B, N]; num_accepted: [B] int64 (a_b <= N); final_token: [B] int64.
    Returns (tokens [B, N+1] int64, num_emitted [B] int64 = a + 1).
    """
    batch, n = draft_tokens.shape
    accepted = _draft_mask(num_accepted, n)  # [B, N]
    tokens = torch.full((batch, n + 1), -1, dtype=torch.int64, device=draft_tokens.device)  # [B, N+1]
    tokens[:, :n] = torch.where(accepted, draft_tokens.to(torch.int64), tokens[:, :n])
    tokens.scatter_(1, num_accepted.unsqueeze(1), final_token.to(torch.int64).unsqueeze(1))
    return tokens, num_accepted + 1


def _acceptance_uniforms(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """[B, n] f32 uniforms U_1..U_n in (0, 1) for one verify step: uniform(seed, positions, stream, n).

    Keyed by (seed, position of the step's first draft, stream) with the draft index as the Philox
    column, NOT by the position of each draft. The two keyings agree in spirit (pure functions of
    seed/position/stream, independent of the batch and of padding: a longer draw extends a shorter
    one), but only this one keeps steps independent under block verification. There τ depends on
    U_i for every i <= N, including i > τ, which the algorithm inspects and finds U_i > h_i; the next
    step starts at position positions + τ + 1, so keying by draft position would hand that step
    acceptance uniforms already known to be large. Steps of one request start at strictly increasing
    positions, so per-step keys are never reused.
    """
    return uniform(seeds, positions, stream, n)


def _sample_residual(
    target_probs: Tensor,
    draft_probs: Tensor,
    row: Tensor,
    scale: Tensor,
    is_bonus: Tensor,
    seeds: Tensor,
    positions: Tensor,
    recover_stream: int,
) -> Tensor:
    """[B] tokens drawn from norm(max(scale·p_{row+1} − q_{row+1}, 0)), or from p_{row+1} where
    is_bonus (row = N_b) or where that residual has no mass.

    target_probs [B, N+1, V]; draft_probs [B, N, V]; row [B] int64 in [0, N]; scale [B] f32.
    Gumbel-max over log(residual) (-inf where 0) needs no normalisation: argmax(log r + g) ~ r / Σr,
    with g = gumbel(seed, positions + row, recover_stream, V), the noise of the emitted position.
    """
    batch, n, vocab = draft_probs.shape
    p = target_probs.gather(1, row.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    if n > 0:
        q_row = row.clamp(max=n - 1).view(batch, 1, 1).expand(batch, 1, vocab)
        q = draft_probs.gather(1, q_row).squeeze(1)  # [B, V]; meaningless where is_bonus
        residual = (scale.unsqueeze(1) * p - q).clamp(min=0.0)  # [B, V]
        # where() rather than arithmetic: padded draft_probs rows may hold garbage (even NaN).
        use_p = is_bonus | ~(residual.sum(dim=-1) > 0)  # [B]
        dist = torch.where(use_p.unsqueeze(1), p, residual)  # [B, V]
    else:
        dist = p
    noise = gumbel(seeds, positions + row, recover_stream, vocab)  # [B, V]
    return (dist.log() + noise).argmax(dim=-1)  # [B]


# ---------------------------------------------------------------------------------------------- greedy


def verify_greedy(target_argmax: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy (temperature 0) verification: the longest prefix of drafts equal to the target argmax.

    target_argmax: [B, N+1] int64, row i = target argmax after draft i (row 0 after the anchor).
    draft_tokens:  [B, N] int64 (padding beyond num_drafts[b] arbitrary).
    num_drafts:    [B] int64, 0 <= num_drafts[b] <= N.
    Returns (tokens [B, N+1] int64 padded with -1, num_emitted [B] int64).

        accept X_i  <=>  X_j == argmax_{j-1} for all j <= i  (and i <= N_b)
        a = #accepted;  emit X_1..X_a, argmax_a   (recovered if a < N_b, else the bonus)
    """
    batch, n = draft_tokens.shape
    assert target_argmax.shape == (batch, n + 1), (target_argmax.shape, draft_tokens.shape)
    target_argmax = target_argmax.to(torch.int64)
    num_drafts = num_drafts.to(torch.int64)
    match = (draft_tokens.to(torch.int64) == target_argmax[:, :n]) & _draft_mask(num_drafts, n)  # [B, N]
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]: length of the all-true prefix
    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return _emit(draft_tokens, num_accepted, final)


# ------------------------------------------------------------------------------------------ stochastic


def verify_probabilistic(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    method: str,
    accept_stream: int = STREAM_ACCEPT,
    recover_stream: int = STREAM_RECOVER,
) -> tuple[Tensor, Tensor]:
    """Lossless speculative verification of drafts sampled from q: the emitted tokens are distributed
    exactly as sampling them one by one from the target p.

    target_probs: [B, N+1, V] f32, p_{i+1} = target distribution (temperature/top-k/top-p applied)
                  after draft i; row 0 after the anchor.
    draft_tokens: [B, N] int64 X_1..X_N (padding beyond num_drafts[b] arbitrary).
    draft_probs:  [B, N, V] f32, q_i = distribution X_i was sampled from (one-hot for greedy drafts).
    num_drafts:   [B] int64, N_b in [0, N].
    seeds:        [B] int64 request seeds.
    positions:    [B] int64 absolute position of X_1 (X_i decides positions + i - 1; the final
                  token is emitted at positions + accepted).
    method:       "standard" (Leviathan et al. 2023, token-wise) or "block" (Sun et al. 2024,
                  arXiv 2403.10444; never fewer accepted tokens in expectation, also lossless).
    Returns (tokens [B, N+1] int64 padded with -1, num_emitted [B] int64 = accepted + 1).

    With r_i = p_i(X_i) / q_i(X_i) and uniforms U_i (see `_acceptance_uniforms`):

    standard:  a = max{i <= N_b : U_j <= r_j for all j <= i}  (0 if U_1 > r_1)
               emit X_1..X_a, then  Y ~ p_{N_b+1}                   if a = N_b   (bonus)
                                    Y ~ norm(max(p_{a+1} − q_{a+1}, 0))  otherwise (recovered)
    block:     P_0 = 1,  P_i = min(P_{i−1}·r_i, 1)
               h_i = R_i / (R_i + 1 − P_i),  R_i = Σ_x max(P_i·p_{i+1}(x) − q_{i+1}(x), 0)  (i < N_b)
               h_{N_b} = P_{N_b}
               τ = max{i <= N_b : U_i <= h_i}  (0 if none: the LAST such i, not the first)
               emit X_1..X_τ, then  Y ~ p_{N_b+1}                          if τ = N_b
                                    Y ~ norm(max(P_τ·p_{τ+1} − q_{τ+1}, 0))  otherwise
    A residual with no mass (only possible through rounding) falls back to p_{a+1} / p_{τ+1}.
    """
    if method not in METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {METHODS}")
    batch, n = draft_tokens.shape
    vocab = target_probs.shape[-1]
    assert target_probs.shape == (batch, n + 1, vocab), (target_probs.shape, draft_tokens.shape)
    assert draft_probs.shape == (batch, n, vocab), (draft_probs.shape, draft_tokens.shape)
    target_probs = target_probs.float()
    draft_probs = draft_probs.float()
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    num_drafts = num_drafts.to(torch.int64)

    valid = _draft_mask(num_drafts, n)  # [B, N]
    tokens = torch.where(valid, draft_tokens.to(torch.int64), 0).unsqueeze(2)  # [B, N, 1]; padding -> 0
    p_x = target_probs[:, :n].gather(2, tokens).squeeze(2)  # [B, N]  p_i(X_i)
    q_x = draft_probs.gather(2, tokens).squeeze(2)  # [B, N]  q_i(X_i) (> 0 for real drafts)
    ratio = torch.where(valid, p_x / q_x.clamp(min=_TINY), 1.0)  # [B, N]  r_i; padding -> 1
    u = _acceptance_uniforms(seeds, positions, accept_stream, n)  # [B, N]

    if method == "standard":
        accept = (u <= ratio) & valid  # [B, N]: U_i <= min(1, r_i)  (U < 1 always)
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]  a: stop at first rejection
        scale = torch.ones(batch, dtype=torch.float32, device=target_probs.device)  # P = 1 in the residual
    else:
        # P_i over i = 0..N (N is small: a loop over draft slots, not over the vocabulary).
        big_p = [torch.ones(batch, dtype=torch.float32, device=target_probs.device)]
        for i in range(n):
            big_p.append(torch.minimum(big_p[-1] * ratio[:, i], torch.ones_like(ratio[:, i])))
        big_p_all = torch.stack(big_p, dim=1)  # [B, N+1]  P_0..P_N
        p_i = big_p_all[:, 1:]  # [B, N]  P_1..P_N
        # R_i for i = 1..N−1 uses the NEXT slot's distributions p_{i+1} (target row i), q_{i+1}.
        r_mass = (p_i[:, : n - 1].unsqueeze(2) * target_probs[:, 1:n] - draft_probs[:, 1:n]).clamp(min=0.0)
        r_sum = torch.cat([r_mass.sum(dim=2), torch.zeros_like(p_i[:, :1])], dim=1)[:, :n]  # [B, N]  R_i
        den = r_sum + (1.0 - p_i)  # >= 0; == 0 only if R_i = 0 and P_i = 1, where h_i = 1
        h_mid = torch.where(den > 0, r_sum / den.clamp(min=_TINY), 1.0)  # [B, N]
        slot = torch.arange(1, n + 1, device=target_probs.device).unsqueeze(0)  # [1, N]  i (1-based)
        n_b = num_drafts.unsqueeze(1)  # [B, 1]
        h = torch.where(slot < n_b, h_mid, torch.where(slot == n_b, p_i, 0.0))  # [B, N]; 0 past N_b
        hit = u <= h  # [B, N]; U > 0, so h = 0 is never hit
        num_accepted = (hit.to(torch.int64) * slot).amax(dim=1) if n > 0 else num_drafts.new_zeros(batch)  # τ
        scale = big_p_all.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]  P_τ

    is_bonus = num_accepted == num_drafts  # [B]
    final = _sample_residual(
        target_probs, draft_probs, num_accepted, scale, is_bonus, seeds, positions, recover_stream
    )
    return _emit(draft_tokens, num_accepted, final)
