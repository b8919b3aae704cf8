"""Adaptive verification: how many drafts the next steps verify (dspark.md §4, batch-wide).

Verifying N drafts per request costs the target N + 1 query rows per request; at large batch those rows
are what the GPU is busy with, and late drafts are seldom accepted (at temperature 1 the shipped drafter's
conditional acceptance is ~0.5 per slot, so the 7th draft survives ~1 % of the time). The paper's scheduler
(dspark.md §4) picks per-request lengths maximising Θ = τ · SPS(B). dspark's CUDA graphs give every request
of a step the same q = 1 + N rows, so here N is one number for the whole batch, picked from
``SpeculativeConfig.verify_lengths`` (one set of graphs captured per length):

    Θ(N) = Σ_r (1 + Σ_{j ≤ N} a_{r,j}) / t(N, B)

with a_{r,j} the estimated probability that request r's first j drafts are all accepted (the product of
the conditional acceptances up to j) and t(N, B) the time of a step verifying N drafts for B requests:
the graphs' GPU time, profiled at start-up (``StepGraphs.profile``), against the host's time per step,
learnt from the read-backs (``VerifyLengthPolicy``: a pipelined step waits for the slower of the two).
The acceptance estimates are the
measured per-position conditional acceptance of recent steps (``AcceptanceEstimate``), kept apart for
greedy and sampled requests; the drafter's confidence head is not read (the graphs do not compute it:
with one N for the batch, per-request confidences would only be summed anyway; a ragged per-request
length would need them).

Losslessness: the N of a step is decided from steps already read back, never from the step's own
verification, so each step's tokens are exact (greedy: the argmax chain; sampled: exact samples) whatever N
is. What does change with N is which exact sample a seeded sampled request gets (its keys are the same,
the verified drafts are not), so with adaptive lengths a seeded sampled request's text depends on the load.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Hashable, Sequence

import numpy as np

GREEDY, SAMPLED = 0, 1


class AcceptanceEstimate:
    """Per-position conditional acceptance P(draft j accepted | drafts < j accepted), greedy and sampled
    requests apart, from decayed counts: each step's counts are added after the earlier ones were
    multiplied by ``decay`` — only at the positions the step reached, so positions that the current
    length does not verify keep the estimate they had when they were last verified. A position with few
    observations (late slots are seldom reached) leans on the pooled rate of all positions, with
    ``prior_weight`` pseudo-observations of it."""

    def __init__(self, num_positions: int, decay: float = 0.98, min_reached: float = 16.0,
                 prior_weight: float = 4.0) -> None:
        self.decay, self.min_reached, self.prior_weight = decay, min_reached, prior_weight
        self.reached = np.zeros((2, num_positions))
        self.accepted = np.zeros((2, num_positions))
        # this step's verifications, (sampled, num_drafts, num_accepted) per request: a list append per
        # request (the host's per-step path at batch 128), counted once per step in end_step
        self._pending: list[tuple[bool, int, int]] = []

    def observe(self, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: num_drafts verified, the first num_accepted of them accepted."""
        self._pending.append((sampled, num_drafts, num_accepted))

    def end_step(self) -> None:
        if not self._pending:
            return
        new_r, new_a = np.zeros_like(self.reached), np.zeros_like(self.accepted)
        for (sampled, n, a), c in Counter(self._pending).items():
            new_r[int(sampled), :min(a + 1, n)] += c
            new_a[int(sampled), :a] += c
        self._pending.clear()
        seen = new_r > 0
        self.reached[seen] = self.decay * self.reached[seen] + new_r[seen]
        self.accepted[seen] = self.decay * self.accepted[seen] + new_a[seen]

    def survival(self, kind: int) -> np.ndarray | None:
        """a_j for j = 1..num_positions (the product of the conditional acceptances up to j), or None while
        there are too few observations to say."""
        r, a = self.reached[kind], self.accepted[kind]
        total = r.sum()
        if total < self.min_reached:
            return None
        pooled, w = a.sum() / total, self.prior_weight
        return np.cumprod((a + w * pooled) / (r + w))


class _LengthChoice:
    """What every verify-length chooser shares with the engine (LLMEngine._choose_length /
    _adapt_verify_length / _record_spec): the acceptance estimate the engine feeds, and the hysteresis —
    a decision every ``interval`` steps, none within ``min_steps`` steps of a change (a change drains the
    async pipeline once: one step's host work is not overlapped)."""

    def __init__(self, estimate: AcceptanceEstimate | None, min_steps: int, interval: int) -> None:
        self.estimate = estimate
        self.min_steps, self.interval = min_steps, interval
        self.steps_since_change = min_steps  # no change yet: free to choose
        self.steps = 0
        self.changes = 0

    def due(self) -> bool:
        """Whether this step decides (every ``interval`` steps, and not too soon after a change)."""
        return self.steps % self.interval == 0 and self.steps_since_change >= self.min_steps

    def observe_step(self, n: int, batch: int, sampled: bool, interval: float, wait: float) -> None:
        """A pipelined read-back's timing (VerifyLengthPolicy learns from it)."""

    def changed(self) -> None:
        """The engine moved to another length."""
        self.steps_since_change = 0
        self.changes += 1

    def tick(self) -> None:
        """One more verification step read back (its observations are in ``estimate``)."""
        if self.estimate is not None:
            self.estimate.end_step()
        self.steps_since_change += 1
        self.steps += 1


class VerifyLengthPolicy(_LengthChoice):
    """Picks the number of drafts to verify (one of ``lengths``) for a batch of greedy and sampled
    requests: the Θ-maximising one, with hysteresis — it moves away from ``current`` only if that gains
    more than ``margin`` and at least ``min_steps`` steps were taken since the last change (every change
    drains the async pipeline once: one step's host work is not overlapped). It decides every
    ``interval`` steps (the batch and the estimates change slowly; the decision is host work).

    Step times. ``step_time(n, batch, any_sampled)`` is the GPU time of the step's graphs (profiled).
    With async scheduling the host prepares step t + 1 while the GPU runs step t, so a pipelined step
    takes max(GPU, host), not their sum: a host-bound batch gains nothing from shorter GPU steps and
    loses the drafts it no longer verifies. Measured on the H200 (session 26, T = 1, batch 32): 3 drafts
    instead of 7 took the graphs from 1.82 to 1.45 ms, but a real step stayed at ~3 ms, the host's time,
    and throughput fell 7 %; a policy that added a constant overhead to the GPU time chose 3 drafts there.
    So from each pipelined read-back (``observe_step``: the interval since the one before, and how long
    the host waited for the GPU in it) the policy learns, per batch-size bucket, the host's time per step
    (interval − wait) and what neither explains (interval − max(GPU, host): bubbles, admissions), and
    takes t(n, B) = max(step_time(n, B), host(B)) + rest(B). The host's work is taken as the same for
    every length (it shrinks a little with fewer drafts: the model errs towards longer blocks).

    That model only predicts; a length the batch-size bucket has run at is timed instead. The read-back
    interval of each (bucket, length) is kept too (``measured``: a running mean once ``min_timed`` steps
    were seen), and t(n, B) is that measured interval where there is one. So a move the model suggests
    is tried and then judged on what it measured: on the H200 (session 31, T = 1, batch 128) the model
    put 3 drafts 13-16 % ahead of 7 (the profile replays graphs on padding rows and leaves the drafter
    out, so ``rest`` absorbed a constant that scales with neither), just over the 10 % margin then in
    use, and the policy stayed at 7 in one process and left it after 357 steps in another, where the
    steps measured 1.24x / 1.01x plain at 3 / 7 drafts. A wrong move costs one drained pipeline and is
    undone once measured, so the margin is 5 %. And since the model errs that way, a length not yet
    timed in the bucket is tried (once the current one is timed) whenever the model puts it within
    ``explore`` (10 %) of the current one: at T = 1 batch 32 the same arithmetic puts 3 drafts 2 % ahead
    of 7 where the bench measured 1.39x against 1.21x plain. Trying costs ``min_steps`` steps at a
    length at most 10 % worse by the model, once per bucket and length (``explore=None``: never)."""

    def __init__(self, lengths: tuple[int, ...], step_time: Callable[[int, int, bool], float],
                 estimate: AcceptanceEstimate, margin: float = 0.05, min_steps: int = 16, interval: int = 8,
                 time_weight: float = 0.05, min_timed: int = 8, explore: float | None = 0.1) -> None:
        super().__init__(estimate, min_steps, interval)
        self._kw = dict(margin=margin, min_steps=min_steps, interval=interval, time_weight=time_weight,
                        min_timed=min_timed, explore=explore)
        self.lengths = tuple(sorted(lengths))
        self.step_time = step_time  # (num_drafts, batch size, any sampled request) -> seconds per step
        self.margin = margin
        self.time_weight = time_weight
        # batch-size bucket -> (host seconds per step, seconds neither the GPU nor the host explain)
        self.host: dict[int, tuple[float, float]] = {}
        # (batch-size bucket, length) -> (read-back interval: running mean, steps seen)
        self.measured: dict[tuple[int, int], tuple[float, int]] = {}
        self.min_timed = min_timed
        self.explore = explore

    def fresh(self) -> "VerifyLengthPolicy":
        """The same policy with no history (after the warm-up: its acceptance says nothing of real requests)."""
        return VerifyLengthPolicy(self.lengths, self.step_time, AcceptanceEstimate(max(self.lengths)), **self._kw)

    @staticmethod
    def _bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def observe_step(self, n: int, batch: int, sampled: bool, interval: float, wait: float) -> None:
        """A pipelined step verifying n drafts for ``batch`` requests, read back ``interval`` seconds after
        the step before, the host having waited ``wait`` of them for the GPU. An interval over ten times
        the GPU's (a pause of the process: the collector, the OS) is left out."""
        gpu = self.step_time(n, batch, sampled)
        if interval > 10 * gpu:
            return
        host = max(interval - wait, 0.0)
        rest = max(interval - max(gpu, host), 0.0)
        k = self._bucket(batch)
        old = self.host.get(k)
        w = self.time_weight
        self.host[k] = (host, rest) if old is None else (old[0] + w * (host - old[0]), old[1] + w * (rest - old[1]))
        t, c = self.measured.get((k, n), (interval, 0))
        # the plain mean of the first steps, then an exponential one (weight time_weight)
        self.measured[(k, n)] = (t + max(w, 1.0 / (c + 1)) * (interval - t), c + 1)

    def real_step_time(self, n: int, batch: int, sampled: bool) -> float:
        """t(n, B): the measured read-back interval of this length and batch-size bucket once there is
        one (``min_timed`` steps), else the model's max(GPU time, host time) + the rest (both learnt;
        the GPU time alone before any)."""
        k = self._bucket(batch)
        t, c = self.measured.get((k, n), (0.0, 0))
        if c >= self.min_timed:
            return t
        host, rest = self.host.get(k, (0.0, 0.0))
        return max(self.step_time(n, batch, sampled), host) + rest

    def throughput(self, n: int, num_greedy: int, num_sampled: int) -> float | None:
        """Θ(n): expected tokens per second of a step verifying n drafts per request."""
        tokens = float(num_greedy + num_sampled)
        for kind, count in ((GREEDY, num_greedy), (SAMPLED, num_sampled)):
            if count:
                a = self.estimate.survival(kind)
                if a is None:
                    return None
                tokens += count * float(a[:n].sum())
        return tokens / self.real_step_time(n, num_greedy + num_sampled, num_sampled > 0)

    def choose(self, current: int, num_greedy: int, num_sampled: int) -> int:
        """The length for the next step (``current`` when the estimates cannot tell yet)."""
        if num_greedy + num_sampled == 0 or self.steps_since_change < self.min_steps:
            return current
        theta = {n: self.throughput(n, num_greedy, num_sampled) for n in self.lengths}
        if any(t is None for t in theta.values()):
            return current
        if self.explore is not None:  # an untimed length the model puts near the current one: time it
            k = self._bucket(num_greedy + num_sampled)
            untimed = [n for n in self.lengths if n != current and self.measured.get((k, n), (0.0, 0))[1] < self.min_timed
                       and theta[n] >= theta[current] * (1 - self.explore)]
            if untimed and self.measured.get((k, current), (0.0, 0))[1] >= self.min_timed:
                return max(untimed, key=lambda n: (theta[n], -n))
        best = max(self.lengths, key=lambda n: (theta[n], -n))
        return best if theta[best] > theta[current] * (1 + self.margin) else current


class SampledBatchRule(_LengthChoice):
    """The sampled-batch rule (``SpeculativeConfig.sampled_verify_length``): a batch whose speculating
    requests are all sampled, at least ``min_batch`` of them, verifies ``short`` drafts; any other batch
    ``long`` (num_speculative_tokens). A fixed rule, not a learnt one, because what it encodes was measured
    where the learnt policy above could not tell the lengths apart: on the H200 3 drafts beat 7 at
    temperature 1 from batch 16–32 up (docs/benchmarks.md, sessions 30–34; session 34, this rule against
    fixed 7 in four processes: +0 to +22 % at batch 32–128, ±6 % at 8–16), while greedy batches up to 64 were
    faster with 7 (session 32), and at batch 1 the target's step costs about the same for fewer rows
    (session 19: block 7 beat block 5 there). Why sampled requests want fewer drafts: their conditional
    acceptance is ~0.5 per slot against ~0.7 greedy, and a sampled draft slot costs more (the Markov loop
    samples and writes the slot's q; verification compares whole distributions).

    Batches with greedy requests (greedy or mixed) verify ``short`` where their size is within
    ``greedy_batches`` (``SpeculativeConfig.greedy_verify_batches``; the shipped drafter: 12 to 32), else
    ``long``. Programmatic dependent launch (session 60) moved the greedy verdict: steps of up to 128 rows
    (few-row kernels) got 12-16 % faster, steps on cuBLAS ~2 %, so on an H100 greedy batch 16 verifying 3
    drafts (64 rows) ran 1.62x plain against 1.42-1.43x with 7 (128 rows), batch 32 1.38-1.41x against
    1.28-1.29x (256 rows, cuBLAS), batch 8 1.71x against 1.75-1.76x (docs/benchmarks.md, session 61, fixed
    3 drafts against fixed 7 in one process). Why: a step's cost goes by the few-row kernels' 64-row blocks up to
    128 rows and by cuBLAS past them — at batch 16 3 drafts are one block against two, at 32 128 rows against 256 on
    cuBLAS, at 8 7 drafts are already one block. The window starts at 12 (not measured; by the same count, 96 rows
    against 48) so that a batch of 16 dipping while requests finish and others are admitted stays short. A mixed
    batch in the window verifies ``short`` as both kinds do alone; above it ``long`` (no greedy or mixed cell of 64
    or more was measured since).

    The engine drives it as it drives ``VerifyLengthPolicy`` (``_LengthChoice``: the same hysteresis) but
    keeps no acceptance estimate: the rule does not read one (feeding it cost the host ~20 µs per step; at
    batch 1 the host's work per step is close to the GPU's step time, session 37)."""

    def __init__(self, short: int, long: int, min_batch: int, min_steps: int = 16, interval: int = 8,
                 greedy_batches: tuple[int, int] | None = None) -> None:
        if not 1 <= short < long:
            raise ValueError(f"the sampled verify length {short} must be in [1, {long})")
        super().__init__(None, min_steps, interval)
        self.short, self.long, self.min_batch = short, long, min_batch
        self.greedy_batches = greedy_batches
        self.lengths = (short, long)

    def fresh(self) -> "SampledBatchRule":
        """The same rule with no history (after the warm-up)."""
        return SampledBatchRule(self.short, self.long, self.min_batch, self.min_steps, self.interval,
                                self.greedy_batches)

    def choose(self, current: int, num_greedy: int, num_sampled: int) -> int:
        """The length for the next step: the short one for an all-sampled batch of at least min_batch, and for a
        batch with greedy requests whose size is within ``greedy_batches``."""
        n = num_greedy + num_sampled
        if n == 0 or self.steps_since_change < self.min_steps:
            return current
        if num_greedy == 0:
            return self.short if n >= self.min_batch else self.long
        g = self.greedy_batches
        return self.short if g is not None and g[0] <= n <= g[1] else self.long


class ConfidenceScheduler:
    """Confidence-scheduled verification (dspark.md §4, the paper's per-request form) for steps that run
    eagerly — the CPU, ``--enforce-eager``, the torch backend — where a step's cost is its rows: every draft
    a request verifies is one more target row. (CUDA-graph steps give every request the same q rows, so
    there the batch-wide policies above choose one length instead.)

    After each drafting, request r's draft j survives verification with probability
    a_{r,j} = c_{r,1} ··· c_{r,j}, the drafter's confidence head (``DSparkDrafter.confidence_logit``, trained
    on 1 − TV: the probability that the draft is accepted given the ones before it were). The next step
    verifies ℓ_r drafts of request r, chosen greedily as the paper does: all (r, j) sorted by a_{r,j},
    admitted one at a time while each admission raises

        Θ = Σ_r (1 + Σ_{j ≤ ℓ_r} a_{r,j}) / (t(Σ_r (1 + ℓ_r)) + t_draft)

    — expected tokens per second of the step, with t(R) the target's measured time for R query rows
    (``row_time``: profiled on the dummy KV block at powers of two, interpolated) and t_draft the
    drafter's measured time for a batch of that size (``draft_time``: the median of the last
    ``draft_window`` draftings of batches in the same power-of-two bucket, so that one slow drafting —
    a compile, the garbage collector, another process — does not count: with a running mean, one such
    drafting kept speculation paused for hundreds of steps, since paused steps measure nothing). The
    requests of the step that do not speculate (penalties) count in R and in the tokens as one row and
    one token each (``others``); requests still prefilling next step are not known here and are left
    out. The admission stops at the first one that does not raise Θ.

    Why it stops there (and not at the best Θ over the whole sorted list, which would sometimes verify
    more): losslessness for sampled requests. Which drafts a step verifies may depend on anything but the
    value of the draft itself given the ones before it; a_{r,j+1} depends on draft j (the confidence head
    reads the previous draft), so a rule that looks past (r, j) in the list before deciding on it would
    verify draft j more or less often depending on its value — and a draft kept or dropped by its own
    value is no longer a sample of q, which biases the rejection sampler's output (a draft verified only
    when it is a token the target likes is accepted too often). Stopping at the first non-improving
    admission decides each (r, j) from the entries ranked above it, which (ties broken by j) are other
    requests' and r's own earlier ones, functions of drafts before j: each emitted token is still an exact
    sample, as ``tests/spec/test_spec_engine.py`` checks statistically.

    Seeded sampled requests are not scheduled (``fixed``): they verify every draft, so that their text
    does not depend on the measured step times that steer ℓ (it follows their seed — and, as without
    scheduling, the step's token budget where ``max_num_batched_tokens`` cuts a verification short,
    Scheduler.schedule). Greedy requests' tokens are the target's argmax chain whatever ℓ is.

    Pausing: Θ of the scheduled step is compared with plain decoding's, B / t(B) with no drafter; when
    plain decoding is ahead (by ``margin``) the next ``pause_steps`` steps draft nothing — the requests
    decode plainly, their drafter context still written — and the step after drafts again to look. Each
    pause that follows another right away is twice as long, up to ``max_pause`` steps (a batch where
    speculation does not pay pays for one drafting in up to max_pause + 1 steps); a step that speculates
    resets it. A pause ends early when the set of speculating requests changes (``key``): it was decided
    for the batch that armed it.
    Drafts already made are not dropped by this (that would decide on their own values, as above); only
    steps not yet drafted are paused. Where the drafter costs a large share of a plain step (a 135 M
    target on a 2-core CPU: ~45 %, and most of its drafts are worth fewer rows at batch 8) speculation then
    costs one drafting in up to ``max_pause + 1`` steps instead of its whole price."""

    def __init__(self, row_time: Callable[[int], float], pause_steps: int = 4, max_pause: int = 64,
                 margin: float = 0.02, draft_window: int = 5) -> None:
        self.row_time = row_time  # R query rows -> seconds of the target step
        self.pause_steps, self.max_pause, self.margin = pause_steps, max_pause, margin
        self.draft_window = draft_window
        self._drafts: dict[int, deque[float]] = {}  # batch bucket -> seconds of its last draftings
        self.paused_left = 0  # steps still to decode without drafting
        self.paused_key: Hashable = None  # the speculating requests the pause was decided for
        self.next_pause = pause_steps  # the length of the next pause (doubles while pauses follow each other)
        self.stats = {"scheduled_steps": 0, "drafts_made": 0, "drafts_kept": 0, "paused_steps": 0, "pauses": 0}

    def reset(self) -> None:
        """Forget the pause and the counts (LLMEngine.warm_up); the measured times stay."""
        self.paused_left, self.next_pause = 0, self.pause_steps
        self.stats = dict.fromkeys(self.stats, 0)

    @staticmethod
    def _bucket(batch: int) -> int:
        return max(0, batch - 1).bit_length()

    def observe_draft(self, batch: int, seconds: float) -> None:
        """One drafting for ``batch`` requests (the proposer's forward and Markov loop, read back) took
        ``seconds``."""
        self._drafts.setdefault(self._bucket(batch), deque(maxlen=self.draft_window)).append(seconds)

    def draft_time(self, batch: int) -> float:
        """t_draft for ``batch`` requests: the median of its bucket's last draftings (0 before any)."""
        q = self._drafts.get(self._bucket(batch))
        return float(np.median(q)) if q else 0.0

    def pause_step(self, key: Hashable = None) -> bool:
        """Whether this step skips drafting (counted as a paused step when it does); ``key`` names the
        speculating requests: a pause armed for others ends here."""
        if self.paused_left <= 0:
            return False
        if key != self.paused_key:
            self.paused_left, self.next_pause = 0, self.pause_steps
            return False
        self.paused_left -= 1
        self.stats["paused_steps"] += 1
        return True

    def schedule(self, survival: Sequence[Sequence[float]], fixed: Sequence[bool], others: int = 0,
                 key: Hashable = None) -> list[int]:
        """survival[i]: request i's a_{i,1..n_i} (n_i = the drafts it may verify), non-increasing in j;
        ``fixed[i]``: it verifies all n_i; ``others``: requests of the next step that decode without
        speculating (a row and a token each); ``key``: these requests (see pause_step). Returns ℓ_i per
        request, and arms the pause when plain decoding would be faster."""
        b = len(survival)
        td = self.draft_time(b)
        rows = b + others
        tokens = float(rows)
        cand = []
        for i, (a, fx) in enumerate(zip(survival, fixed)):
            if fx:
                rows += len(a)
                tokens += float(np.sum(a))
            else:
                cand.extend((-float(x), j, i) for j, x in enumerate(a))
        cand.sort()  # by a descending, then by slot: a request's drafts in order (a is non-increasing in j)
        theta = tokens / (self.row_time(rows) + td)
        lengths = [len(a) if fx else 0 for a, fx in zip(survival, fixed)]
        for neg_a, _, i in cand:
            nxt = (tokens - neg_a) / (self.row_time(rows + 1) + td)
            if nxt <= theta:
                break
            theta, tokens, rows = nxt, tokens - neg_a, rows + 1
            lengths[i] += 1
        s = self.stats
        s["scheduled_steps"] += 1
        s["drafts_made"] += sum(len(a) for a in survival)
        s["drafts_kept"] += sum(lengths)
        if not any(fixed):  # a seeded request drafts every step anyway: nothing to save by pausing
            if theta * (1 + self.margin) < (b + others) / self.row_time(b + others):
                self.paused_left, self.paused_key = self.next_pause, key
                self.next_pause = min(2 * self.next_pause, self.max_pause)
                s["pauses"] += 1
            else:
                self.next_pause = self.pause_steps
        return lengths


class RowTimeTable:
    """t(R): seconds of a target step of R query rows, measured by ``profile(R)`` at powers of two up to
    ``cap`` rows — those of one request's block at start-up (``warm``), larger ones when a batch first needs
    them — linear in between and, past ``cap``, along the last segment's slope (products of many rows are
    compute-bound: linear in R).

    ``warm`` measures its row counts in ``rounds`` interleaved rounds (1, 2, 4, 8, 1, 2, ...) and keeps each
    one's minimum: a slow stretch of the machine (clocks ramping up, another process, the collector) then
    inflates no single row count, which a one-pass table froze for the whole process. Why it matters: the
    table decides every admission, and a t(4) measured high made t(3) look dearer than t(2), so the scheduler
    verified one draft per step for the whole run (H100, eager batch-1 T = 1, session 44: 320 of 2,151 drafts,
    0.88x plain against 1.30x unscheduled; the process before kept most)."""

    def __init__(self, profile: Callable[[int], float], cap: int = 256, rounds: int = 3) -> None:
        self.profile, self.cap, self.rounds = profile, cap, rounds
        self.points: dict[int, float] = {}

    def warm(self, rows: int) -> dict[int, float]:
        """Profile every power of two up to the first at or above ``rows`` now (at start-up, so that the first
        request does not wait for them), in ``rounds`` interleaved rounds; returns the table."""
        todo, r = [], 1
        while True:
            if r not in self.points:
                todo.append(r)
            if r >= min(rows, self.cap):
                break
            r *= 2
        for _ in range(self.rounds):
            for r in todo:
                self.points[r] = min(self.points.get(r, float("inf")), self.profile(r))
        return dict(sorted(self.points.items()))

    def _at(self, r: int) -> float:
        t = self.points.get(r)
        if t is None:
            t = self.points[r] = self.profile(r)
        return t

    def __call__(self, rows: int) -> float:
        rows = max(1, rows)
        lo = 1 << (rows.bit_length() - 1)  # the power of two at or below rows
        if lo >= self.cap:
            lo, hi = self.cap // 2, self.cap
        else:
            hi = lo * 2
        if rows == lo:
            return self._at(lo)
        t_lo, t_hi = self._at(lo), self._at(hi)
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
