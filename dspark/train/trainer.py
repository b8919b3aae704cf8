"""The training loop of a DSpark drafter (DeepSpec recipe, ../shared/docs/dspark.md §5).

AdamW (no weight decay), peak lr 6e-4, linear warm-up over 4 % of the steps then cosine to 0,
grad-norm clip 1.0; bf16 autocast on a GPU (the frozen target in bf16, drafter master weights in
fp32, the shared lm_head in fp32 as the engine keeps it), fp32 on the CPU. Target taps and p_t are recomputed on the fly every step: the target is the
cheap part (one dense forward of SmolLM2 per batch) while caching its taps would take
m·H·2 bytes per token (3·576·2 = 3.5 kB: 3.5 GB per million tokens) plus p_t, which cannot be cached
at all at 49,152 floats per row.

Out directory:
  train_config.json   every hyper-parameter, the drafter config, data summaries, the command
  train_log.jsonl     one JSON line per log interval (losses, τ_prob, lr, grad norm) and per eval
  drafter/            the drafter in DeepSpec format (config.json + ≤16 MiB safetensors shards)
  trainer_state.pt    fp32 drafter weights, optimizer state, step, RNG: what --resume continues from
  metrics.json        final held-out τ_prob and losses
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dspark.models.dspark_drafter import (DrafterConfig, DSparkDrafter, default_target_layer_ids,
                                          drafter_config_dict)
from dspark.models.llama import LlamaForCausalLM
from dspark.train.checkpoint import drafter_state_dict, new_drafter, save_drafter
from dspark.train.data import TokenData
from dspark.train.model import LOSS_WEIGHTS, POSITION_DECAY, LossOutput, draft_losses, training_forward

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
# (from, at): at step ``at`` a time-budgeted run fits its step count again from the pace of steps from..at
# (the first steps are slower: each new sequence length builds its attention and GEMM plans). Session 18
# on the H200: 0.13-0.17 s per step over steps 100-200 against 0.052 s from step 500 on, so the step-200
# fit planned 7,781 steps for a budget that held ~15,000; the third fit uses steps past that warm-up.
REPLANS = ((25, 50), (100, 200), (600, 900))


@dataclass
class TrainConfig:
    out: str  # output directory
    data: str  # training token file(s) (dspark.train.data.TokenData), comma-separated
    # held-out token file(s) for periodic τ_prob, comma-separated: the first gives the ``heldout_*`` metrics,
    # the j-th further one ``heldout{j}_*`` (e.g. a held-out file regenerated at another temperature)
    eval_data: str | None = None
    model: str | None = None  # target: name, .gguf or HF directory (None: smollm2-135m-instruct)
    block_size: int = 5  # γ: block slots = drafts per step
    num_layers: int = 2  # drafter decoder layers
    markov_rank: int = 64  # r of the Markov head (0: none)
    target_layer_ids: list[int] | None = None  # taps; None: 3 spread layers (default_target_layer_ids)
    mask_token_id: int = 16  # SmolLM2's <empty_output>
    steps: int = 2000  # optimizer steps (an upper bound when time_budget_s is set)
    time_budget_s: float | None = None  # fit the step count (and the cosine) to this wall time
    stop_after_s: float | None = None  # end this invocation then (checkpoint saved; --resume goes on, same schedule)
    batch_size: int = 8  # sequences per step
    seq_len: int = 1024  # sequences are cut to their first seq_len tokens
    anchors_per_seq: int = 128  # K: blocks per sequence per step
    lr: float = 6e-4
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    eval_every: int = 200  # steps between held-out evaluations (0: only at the end)
    eval_seqs: int = 64  # held-out sequences per evaluation
    save_every: int = 500  # steps between checkpoints (0: only at the end)
    log_every: int = 10
    seed: int = 0  # drafter init, batch and anchor sampling
    device: str = "auto"
    save_dtype: str = "bfloat16"  # dtype of the exported drafter tensors
    resume: bool = False  # continue from out/trainer_state.pt
    restart_steps: int | None = None  # with resume: a warm restart, a new warm-up + cosine of this many steps
    init_from: str | None = None  # a drafter directory (DeepSpec format, same config) to start from, not random
    # GPU only: the fp32 lm_head products (drafter logits forward and backward, target logits) on TF32 tensor
    # cores. The bf16 lm_head weights are exact in TF32 and the hidden states keep 10 mantissa bits, more
    # than the bf16 hidden states the engine multiplies (models/llama.py use_half_lm_head). Measured on the
    # H200 (session 14, B=16 x 1,024 tokens, 10,200 labelled rows): 92.2 -> 61.5 ms per step, same loss.
    tf32: bool = True
    compile_loss: bool = False  # GPU only: torch.compile the loss over the [rows, vocab] tensors (fewer passes)
    extra: dict[str, Any] = field(default_factory=dict)  # recorded as-is (e.g. data generation settings)


def cosine_lr(step: int, total_steps: int, warmup_frac: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warm-up, then cosine to 0."""
    warm = max(1, round(warmup_frac * total_steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, total_steps - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


# make_batch rounds the batch's length up to a multiple of this. Every new [B, S] shape costs the GPU
# new attention and GEMM plans: with S the longest sequence of each batch (~500 distinct values), a
# process ran 2-4x slower than its steady pace for its first 500-1,000 steps (session 18 on the H200).
# Padding is loss-neutral: padded columns hold no label and no anchor (sample_anchors), the target is
# causal and a block sees context before its anchor only (tests/train: test_padding_changes_no_loss).
SEQ_BUCKET = 64


def make_batch(data: TokenData, idx: list[int], seq_len: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences idx cut to seq_len and right-padded to a multiple of SEQ_BUCKET (at most seq_len)
    -> (tokens [B, S] int64, loss_mask [B, S] bool)."""
    seqs = [data.sequence(i) for i in idx]
    longest = max(t.numel() for t, _ in seqs)
    S = min(seq_len, -(-longest // SEQ_BUCKET) * SEQ_BUCKET)
    tokens = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.bool)
    for b, (t, m) in enumerate(seqs):
        n = min(S, t.numel())
        tokens[b, :n], mask[b, :n] = t[:n], m[:n]
    return tokens.to(device), mask.to(device)


def usable_sequences(data: TokenData, seq_len: int) -> list[int]:
    """Sequences with at least one anchor (p, p+1 both response tokens) inside their first seq_len tokens."""
    out: list[int] = []
    for i in range(len(data)):
        _, m = data.sequence(i)
        m = m[:seq_len]
        if bool((m[:-1] & m[1:]).any()):
            out.append(i)
    return out


class Trainer:
    def __init__(self, cfg: TrainConfig, command: list[str] | None = None) -> None:
        from dspark.engine.llm_engine import resolve_device
        from dspark.models.loader import load_model

        self.cfg = cfg
        self.command = command if command is not None else sys.argv
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(resolve_device(cfg.device))
        cuda = self.device.type == "cuda"
        self.target_dtype = torch.bfloat16 if cuda else torch.float32
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
        if cuda:  # process-wide: this process trains, so its fp32 matmuls are the trainer's
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        self.losses_fn = draft_losses
        if cuda and cfg.compile_loss:
            self.losses_fn = torch.compile(draft_losses, dynamic=True)
        self.save_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                           "float16": torch.float16}[cfg.save_dtype]

        loaded = load_model(cfg.model, self.target_dtype, str(self.device))
        mc = loaded.config
        self.target_name = loaded.name
        ids = cfg.target_layer_ids or default_target_layer_ids(mc.num_hidden_layers, 3)
        self.drafter_config = drafter_config_dict(mc, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                                  mask_token_id=cfg.mask_token_id, target_layer_ids=ids,
                                                  markov_rank=cfg.markov_rank)
        dc = DrafterConfig.from_dict(self.drafter_config)
        dc.check_target(mc)
        max_pos = cfg.seq_len + cfg.block_size + 1
        with torch.device(self.device):
            self.target = LlamaForCausalLM(mc, max_pos, tuple(dc.target_layer_ids)).to(self.target_dtype)
            self.target.lm_head.float()  # fp32 logits, as in the engine (models/llama.py)
        self.target.load_hf_state_dict(loaded.state_dict)
        del loaded
        self.target.eval().requires_grad_(False)
        self.drafter: DSparkDrafter = new_drafter(dc, self.target, max_pos, cfg.seed, self.device)
        if cfg.init_from and not (cfg.resume and (self.out / "trainer_state.pt").is_file()):
            self._init_from(cfg.init_from, dc)  # a resumed run continues from its own checkpoint instead
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)

        self.data = TokenData.load_many(cfg.data)  # one file or several, comma-separated
        self.train_idx = usable_sequences(self.data, cfg.seq_len)
        if not self.train_idx:
            raise ValueError(f"{cfg.data}: no sequence has two response tokens within seq_len {cfg.seq_len}")
        self.eval_sets: list[tuple[TokenData, list[int]]] = []
        for f in (cfg.eval_data.split(",") if cfg.eval_data else []):
            d = TokenData.load(f)
            self.eval_sets.append((d, usable_sequences(d, cfg.seq_len)[:cfg.eval_seqs]))
        self.eval_data = self.eval_sets[0][0] if self.eval_sets else None
        self.eval_idx = [i for _, idx in self.eval_sets for i in idx]  # all held-out rows (for the time plan)
        self.step = 0
        self.total_steps = cfg.steps
        self.schedule = 0  # warm restarts so far: each schedule draws its own batches
        self.log_path = self.out / "train_log.jsonl"

    def _init_from(self, path: str, dc: DrafterConfig) -> None:
        """Start from a trained drafter's weights (e.g. the shipped one, to go on training it in a later
        session, whose machine no longer has trainer_state.pt): same config required, except that this
        run may have more layers (a deeper drafter grown from a trained one): the trained layers come
        first, each new layer keeps its random init but with its two residual-branch outputs (o_proj,
        down_proj) zeroed, so it starts as the identity and the grown drafter drafts exactly as the
        trained one did (the context K/V of every layer come from the shared fc(taps), not from the
        layer below). It may also have another block size: no parameter depends on it (a block's rows
        are the anchor token and mask tokens, told apart by their RoPE positions only), so a drafter
        trained at block 5 starts a block-7 run with all its weights and learns the new slots. And it may
        tap more target layers (``target_layer_ids`` a superset of the checkpoint's): ``fc`` takes the
        concatenated taps, so each trained tap keeps its block of fc's columns at its new place and each
        new tap gets zero columns: fc(taps) — hence every layer's context — starts exactly as before and
        training lets the new taps in.
        The optimizer starts fresh."""
        from safetensors.torch import load_file

        from dspark.train.checkpoint import drafter_state_dict

        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"init_from {path!r}: no config.json there")
        theirs = DrafterConfig.from_dict(json.loads((p / "config.json").read_text()))
        diff = {k: (getattr(theirs, k), getattr(dc, k)) for k in asdict(dc) if getattr(theirs, k) != getattr(dc, k)}
        grow = "num_hidden_layers" in diff and theirs.num_hidden_layers < dc.num_hidden_layers
        more_taps = "target_layer_ids" in diff and set(theirs.target_layer_ids) < set(dc.target_layer_ids)
        allowed = {"block_size"} | ({"num_hidden_layers"} if grow else set()) | ({"target_layer_ids"} if more_taps else set())
        if set(diff) - allowed:
            raise ValueError(f"init_from {path!r}: its config differs from this run's (theirs, ours): {diff}"
                             + (" (only growing the number of layers is supported)" if "num_hidden_layers" in diff else "")
                             + (" (only adding taps is supported)" if "target_layer_ids" in diff else "")
                             + " (the block size may differ)")
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(p.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        if more_taps:  # fc [H, m·H]: tap j's block of columns moves to its place among our taps; new ones zero
            H = dc.hidden_size
            old_fc = sd["fc.weight"]
            fc = old_fc.new_zeros(old_fc.shape[0], len(dc.target_layer_ids) * H)
            for j, layer in enumerate(theirs.target_layer_ids):
                k = dc.target_layer_ids.index(layer)
                fc[:, k * H:(k + 1) * H] = old_fc[:, j * H:(j + 1) * H]
            sd["fc.weight"] = fc
        if grow:
            own = drafter_state_dict(self.drafter)
            for i in range(theirs.num_hidden_layers, dc.num_hidden_layers):
                prefix = f"layers.{i}."
                for name, t in own.items():
                    if name.startswith(prefix):
                        sd[name] = torch.zeros_like(t) if name.endswith(("o_proj.weight", "down_proj.weight")) else t
        self.drafter.load_state_dict_deepspec(sd, self.target.embed_tokens.weight, self.target.lm_head.weight_t)
        self.drafter.float().requires_grad_(True)
        if grow:
            print(f"[train] grown from {path}: layers 0-{theirs.num_hidden_layers - 1} trained, "
                  f"{theirs.num_hidden_layers}-{dc.num_hidden_layers - 1} new (identity at start)", flush=True)
        if "block_size" in diff:
            print(f"[train] block size {theirs.block_size} -> {dc.block_size} (weights of {path} unchanged)", flush=True)
        if more_taps:
            print(f"[train] taps {theirs.target_layer_ids} -> {dc.target_layer_ids} (the new taps' fc columns start at zero)",
                  flush=True)

    # ------------------------------------------------------------------ one step
    def _step_generator(self, step: int) -> torch.Generator:
        """Step ``step``'s batch and anchors depend on (seed, schedule, step) only: a resumed run sees
        the same data as an uninterrupted one, and a warm restart does not replay the first schedule's."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step + 7_919 * 1_000_003 * self.schedule)

    def _train_loss(self, step: int) -> LossOutput:
        g = self._step_generator(step)
        pick = torch.randperm(len(self.train_idx), generator=g)[:self.cfg.batch_size].tolist()
        return self._loss([self.train_idx[i] for i in pick], self.data, g)

    def _loss(self, idx: list[int], data: TokenData, gen: torch.Generator) -> LossOutput:
        tokens, mask = make_batch(data, idx, self.cfg.seq_len, self.device)
        with self.autocast():
            return training_forward(self.target, self.drafter, tokens, mask, self.cfg.anchors_per_seq, gen,
                                    self.losses_fn)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out losses and τ_prob with fixed anchors (row-weighted means over eval_seqs sequences of
        each held-out file): ``heldout_*`` for the first file, ``heldout{j}_*`` for the j-th further one."""
        ev: dict[str, Any] = {}
        for j, (data, idx) in enumerate(self.eval_sets):
            g = torch.Generator().manual_seed(12345)
            acc: dict[str, Any] = {}
            rows = 0
            bs = self.cfg.batch_size
            for i in range(0, len(idx), bs):
                out = self._loss(idx[i:i + bs], data, g)
                for k, v in out.metrics().items():
                    v = torch.tensor(v) * out.num_rows
                    acc[k] = acc[k] + v if k in acc else v
                rows += out.num_rows
            if not rows:
                continue
            res = {k: (v / rows).tolist() for k, v in acc.items()}
            res["accept"] = [round(a, 4) for a in res["accept"]]
            ev.update({f"heldout{j or ''}_{k}": v for k, v in res.items()})
        return ev

    # ------------------------------------------------------------------ bookkeeping
    def _log(self, rec: dict[str, Any]) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def save(self) -> None:
        save_drafter(self.out / "drafter", self.drafter_config, drafter_state_dict(self.drafter), self.save_dtype)
        state = {"step": self.step, "total_steps": self.total_steps, "schedule": self.schedule,
                 "drafter": drafter_state_dict(self.drafter), "optimizer": self.opt.state_dict()}
        tmp = self.out / "trainer_state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "trainer_state.pt")

    def _resume(self) -> None:
        state = torch.load(self.out / "trainer_state.pt", map_location="cpu", weights_only=True)
        self.drafter.load_state_dict_deepspec(state["drafter"], self.target.embed_tokens.weight,
                                              self.target.lm_head.weight_t)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.total_steps = int(state["step"]), int(state["total_steps"])
        self.schedule = int(state.get("schedule", 0))
        if self.cfg.restart_steps is not None:  # warm restart: same weights and Adam moments, new schedule
            if self.cfg.restart_steps < 1:
                raise ValueError(f"restart_steps must be >= 1, got {self.cfg.restart_steps}")
            self.step, self.total_steps, self.schedule = 0, self.cfg.restart_steps, self.schedule + 1

    def _plan_steps(self, budget_s: float) -> int:
        """Steps that fit budget_s: the median of 5 forward/backward passes after 3 warm-ups (no
        optimizer step), and each evaluation budgeted at half a step per batch."""
        times = []
        for i in range(8):
            self._sync()
            t = time.perf_counter()
            self._train_loss(i).total.backward()
            self.opt.zero_grad(set_to_none=True)
            self._sync()
            times.append(time.perf_counter() - t)
        # The first GPU passes include kernel selection and allocator growth (measured on the H200: the
        # first 3-pass estimate was 5x too slow, so the run used a fifth of its budget).
        t_step = sorted(times[3:])[2]
        eval_cost = math.ceil(len(self.eval_idx) / self.cfg.batch_size) * t_step / 2
        per_step = t_step + (eval_cost / self.cfg.eval_every if self.cfg.eval_every else 0)
        left = budget_s - sum(times) - eval_cost  # the final evaluation
        return max(1, min(self.cfg.steps, int(0.95 * left / per_step)))

    def write_config(self, **extra: Any) -> None:
        rec = {**asdict(self.cfg), "command": self.command, "target": self.target_name,
               "drafter_config": self.drafter_config,
               "drafter_parameters": sum(p.numel() for p in self.params), "device": str(self.device),
               "target_dtype": str(self.target_dtype), "autocast_bf16": self.device.type == "cuda",
               "optimizer": {"name": "AdamW", "betas": ADAM_BETAS, "eps": ADAM_EPS, "weight_decay": 0.0},
               "schedule": "linear warm-up over warmup_frac of the steps, then cosine to 0",
               "loss_weights": LOSS_WEIGHTS, "position_weights": f"exp(-(k-1)/{POSITION_DECAY:g})",
               "total_steps": self.total_steps, "train_data_meta": self.data.meta,
               "train_sequences_used": len(self.train_idx),
               "eval_data_meta": self.eval_data.meta if self.eval_data else None,
               "eval_data_metas": [d.meta for d, _ in self.eval_sets],
               "eval_sequences_used": len(self.eval_idx), "torch": torch.__version__, **extra}
        (self.out / "train_config.json").write_text(json.dumps(rec, indent=2))

    # ------------------------------------------------------------------ loop
    def _optimizer_step(self) -> tuple[LossOutput, float, float]:
        """One step at self.step -> (losses, lr, grad norm before clipping)."""
        lr = self.cfg.lr * cosine_lr(self.step, self.total_steps, self.cfg.warmup_frac)
        for g in self.opt.param_groups:
            g["lr"] = lr
        out = self._train_loss(self.step)
        out.total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return out, lr, float(gnorm)

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.perf_counter()
        if cfg.resume and (self.out / "trainer_state.pt").is_file():
            self._resume()
            if cfg.restart_steps is not None:
                self._log({"step": 0, "warm_restart": self.schedule, "total_steps": self.total_steps, "lr": cfg.lr})
        else:
            self.log_path.unlink(missing_ok=True)
            if cfg.time_budget_s is not None:
                self.total_steps = self._plan_steps(cfg.time_budget_s)
        self.write_config()
        if self.eval_idx and self.step == 0:  # the untrained drafter: the baseline of the curve
            self._log({"step": 0, **self.evaluate()})
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step")
        last: dict[str, Any] = {}
        stopped_early = False
        t_log, s_log = time.perf_counter(), self.step
        # The planner's timing passes misjudge the real step time (2.6-10x too slow on the H200, where
        # both a fresh process and a GPU shared by another run skew them), so the step count is fitted
        # again from the measured pace of real steps (REPLANS). Session 14: the pace of the first 50 steps
        # (0.229 s) was 3.7x the steady one (0.062 s), so the run planned 2,470 steps for ~9,000 steps' time.
        replans = dict((at, frm) for frm, at in REPLANS) if cfg.time_budget_s is not None and self.step == 0 else {}
        marks: dict[int, tuple[float, float]] = {}  # step -> (time, evaluation seconds so far)
        eval_s = 0.0
        try:
            while self.step < self.total_steps:
                if self.step in {frm for frm in replans.values()}:
                    marks[self.step] = (time.perf_counter(), eval_s)
                if self.step in replans and replans[self.step] in marks:
                    now = time.perf_counter()
                    t0, e0 = marks[replans[self.step]]
                    per_step = (now - t0 - (eval_s - e0)) / (self.step - replans[self.step])
                    eval_cost = math.ceil(len(self.eval_idx) / cfg.batch_size) * per_step / 2
                    left = cfg.time_budget_s - (now - t_start) - eval_cost
                    per = per_step + (eval_cost / cfg.eval_every if cfg.eval_every else 0)
                    self.total_steps = max(self.step + 1, min(cfg.steps, self.step + int(0.97 * left / per)))
                    bar.total = self.total_steps
                    self._log({"step": self.step, "replanned_total_steps": self.total_steps,
                               "measured_s_per_step": per_step})
                elapsed = time.perf_counter() - t_start
                if (cfg.time_budget_s is not None and elapsed > cfg.time_budget_s) or (
                        cfg.stop_after_s is not None and elapsed > cfg.stop_after_s):
                    stopped_early = True
                    break
                out, lr, gnorm = self._optimizer_step()
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    now = time.perf_counter()
                    last = {"step": self.step, "lr": lr, "grad_norm": gnorm, **out.metrics(),
                            "s_per_step": (now - t_log) / (self.step - s_log), "elapsed_s": now - t_start}
                    t_log, s_log = now, self.step
                    self._log(last)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau_prob']:.2f}")
                periodic_eval = cfg.eval_every and self.step % cfg.eval_every == 0
                if self.eval_idx and periodic_eval and self.step < self.total_steps:
                    t_eval = time.perf_counter()
                    ev = self.evaluate()
                    eval_s += time.perf_counter() - t_eval
                    self._log({"step": self.step, **ev})
                    more = "".join(f", file {j}: {ev[f'heldout{j}_tau_prob']:.3f}" for j in range(1, len(self.eval_sets))
                                   if f"heldout{j}_tau_prob" in ev)
                    bar.write(f"step {self.step}: held-out tau_prob {ev.get('heldout_tau_prob', float('nan')):.3f} "
                              f"accept {ev.get('heldout_accept')}{more}")
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
        except KeyboardInterrupt:  # keep what was done: --resume continues from here
            bar.close()
            self.save()
            raise
        bar.close()
        self.save()
        final = {"steps": self.step, "total_steps": self.total_steps, "stopped_at_time_budget": stopped_early,
                 "train_time_s": time.perf_counter() - t_start, "last_train": last,
                 "drafter_parameters": sum(p.numel() for p in self.params)}
        if self.eval_idx:
            final.update(self.evaluate())
            self._log({"step": self.step, **{k: v for k, v in final.items() if k.startswith("heldout")}})
        (self.out / "metrics.json").write_text(json.dumps(final, indent=2))
        self.write_config(steps_done=self.step)
        return final


def train(cfg: TrainConfig, command: list[str] | None = None) -> dict[str, Any]:
    return Trainer(cfg, command).train()
