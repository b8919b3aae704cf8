"""Why is the engine's temperature-1 acceptance (~0.4 per slot) below the trainer's held-out 1 − TV
(~0.67 at slot 1)? CPU, fp32. Three measurements over the same held-out prompts:

  1. teacher-forced drafter (the trainer's forward, dspark/train/model.py) over the first MAX_NEW
     response tokens of (a) the T = 0.7 / top-p 0.8 / top-k 20 regenerations of the held-out token file
     (the trainer's τ_prob data) and (b) the target's own T = 1 continuations, sampled here by the
     engine without speculation: per-slot mean 1 − TV(q, p) at T = 1, argmax agreement, and the
     per-block chain τ_prob = 1 + Σ_k Π_{i≤k} (1 − TV_i), at EVERY anchor of those tokens;
  2. the engine's own T = 1 DSpark run (probabilistic drafting, standard rejection, torch backend):
     ModelRunner._verify / _verify_probabilistic are wrapped to read the p and q the rejection sampler
     receives. Per slot k reached (drafts < k accepted): Σ_x min(p_k, q_k) (the expected acceptance
     given that context) next to the empirical acceptance, and E_{x~q}[q(x)] vs q(x_drafted) (are
     the drafts sampled from the q used in rejection?);
  3. alignment: the trainer's forward over the spec run's final sequences at the very anchors the
     engine verified; for every slot the engine reached, TV(q_engine, q_trainer), TV(p_engine,
     p_trainer) and the trainer's 1 − TV at that context (the accepted drafts are the sequence's
     tokens, so the teacher-forced context is the engine's context).

    python benchmarks/drafter_t1_check.py HELDOUT.safetensors [--drafter DIR] [--prompts 16] [--max-new 160]
        [--no-evaluate] [--out FILE.json]

Also reported: the trainer's own evaluate() (its held-out τ_prob: 64 sequences, whole responses) and
teacher forcing over the whole T = 0.7 responses of the same prompts, to separate "where the anchors
sit" from "which text the contexts are".
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark import LLM, SamplingParams
from dspark.drafters import shipped_drafter
from dspark.train.data import TokenData
from dspark.train.model import Blocks, drafter_block_hidden, target_forward
from dspark.train.trainer import TrainConfig, Trainer


def one_minus_tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.minimum(a, b).sum(-1)


@torch.no_grad()
def tf_logits(tr: Trainer, tokens: list[int], anchors: list[int], G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft and target logits [K, G, V] of the blocks at ``anchors`` of one sequence
    (the trainer's forward; Markov prev = the sequence's token at p + k − 1; slots past the sequence
    are garbage, never read)."""
    d = tr.drafter
    x = torch.tensor(tokens)[None]
    S = x.shape[1]
    hidden, taps = target_forward(tr.target, x)
    outs_d, outs_t = [], []
    for c in range(0, len(anchors), 64):
        a = torch.tensor(anchors[c:c + 64])[None]  # [1, K]
        K = a.shape[1]
        pos = a[:, :, None] + torch.arange(G)  # [1, K, G]
        pc = pos.clamp(max=S - 1)
        blk = torch.full_like(pos, d.config.mask_token_id)
        blk[:, :, 0] = x.gather(1, a)
        prev = x.gather(1, pc.flatten(1)).view_as(pos)
        valid = torch.ones_like(a, dtype=torch.bool)
        blocks = Blocks(a, valid, blk, pos, prev, valid[:, :, None].expand_as(pos), prev)
        h = drafter_block_hidden(d, taps, blocks)  # [1, K·G, H]
        outs_d.append((d.base_logits(h.reshape(-1, h.shape[-1])) + d.markov_bias(prev.reshape(-1))).view(K, G, -1))
        outs_t.append(tr.target.compute_logits(hidden[0, pc.reshape(-1)]).view(K, G, -1))
    return torch.cat(outs_d), torch.cat(outs_t)


@torch.no_grad()
def teacher_forced(tr: Trainer, prompts: list[list[int]], responses: list[list[int]], G: int) -> dict:
    """Every anchor p with p, p+1 response tokens; slot k counts while p+k is inside the response."""
    tv_sum, agree, cnt, taus = torch.zeros(G), torch.zeros(G), torch.zeros(G), []
    for p, r in zip(prompts, responses):
        if len(r) < 2:
            continue
        seq = p + r
        L = len(p)
        anchors = list(range(L, len(seq) - 1))
        dl, tl = tf_logits(tr, seq, anchors, G)
        acc = one_minus_tv(dl.softmax(-1), tl.softmax(-1))  # [K, G]
        m = (dl.argmax(-1) == tl.argmax(-1)).float()
        lab = (torch.tensor(anchors)[:, None] + torch.arange(1, G + 1)[None]) < len(seq)  # [K, G]
        acc, m = acc * lab, m * lab
        tv_sum += acc.sum(0)
        agree += m.sum(0)
        cnt += lab.float().sum(0)
        taus.append(1 + acc.cumprod(-1).sum(-1))
    t = torch.cat(taus)
    return {"one_minus_tv": [round(v, 4) for v in (tv_sum / cnt).tolist()],
            "argmax_agreement": [round(v, 4) for v in (agree / cnt).tolist()],
            "tau_prob_per_block": round(t.mean().item(), 4), "blocks": int(t.numel())}


def trainer_with_drafter(drafter_dir: str, heldout: str) -> tuple[Trainer, int]:
    """A CPU fp32 Trainer (the default target) holding the drafter in ``drafter_dir``, for teacher forcing
    (``tf_logits``) and its own ``evaluate()`` on ``heldout``; and the drafter's block size."""
    dcfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    G = dcfg["block_size"]
    tr = Trainer(TrainConfig(out="/tmp/drafter_t1_check", data=heldout, model=None, device="cpu",
                             block_size=G, num_layers=dcfg["num_hidden_layers"], markov_rank=dcfg["markov_rank"],
                             target_layer_ids=dcfg["target_layer_ids"], mask_token_id=dcfg["mask_token_id"],
                             eval_data=heldout, eval_seqs=64, batch_size=4, anchors_per_seq=128, seq_len=1024))
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(drafter_dir + "/*.safetensors")):
        sd.update(load_file(f))
    tr.drafter.load_state_dict_deepspec(sd, tr.target.embed_tokens.weight, tr.target.lm_head.weight_t)
    tr.drafter.float().eval()
    return tr, G


class Recorder:
    """Wraps a ModelRunner's verification to keep what its rejection sampler receives."""

    def __init__(self, runner, keep_max: int) -> None:
        self.runner, self.keep_max = runner, keep_max
        self.steps: list[dict] = []  # per request-step: rid, anchor position, n drafts, accepted, per-slot stats
        self.kept: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = []  # (rid, anchor, slot k, p_k, q_k)
        self._ctx: list = []
        orig_verify, orig_prob = runner._verify, runner._verify_probabilistic

        def verify(verifying, logits, offset, result):
            self._ctx = [s.request for _, s in verifying if not s.request.params.greedy]
            return orig_verify(verifying, logits, offset, result)

        def verify_probabilistic(method, probs, drafts, q, num_drafts, seeds, pos):
            out, n_out = orig_prob(method, probs, drafts, q, num_drafts, seeds, pos)
            N = q.shape[1]
            smin = one_minus_tv(probs[:, :N], q)  # [B, N]
            qq = (q * q).sum(-1)  # E_{x~q} q(x)
            qx = q.gather(2, drafts[:, :, None]).squeeze(2)
            px = probs[:, :N].gather(2, drafts[:, :, None]).squeeze(2)
            for j, r in enumerate(self._ctx):
                n, acc = int(num_drafts[j]), int(n_out[j]) - 1
                a = int(pos[j]) - 1  # the anchor's position
                self.steps.append({"rid": r.request_id, "anchor": a, "n": n, "acc": acc,
                                   "smin": smin[j, :n].tolist(), "qq": qq[j, :n].tolist(),
                                   "qx": qx[j, :n].tolist(), "px": px[j, :n].tolist()})
                for k in range(min(acc + 1, n)):
                    if len(self.kept) < self.keep_max:
                        self.kept.append((r.request_id, a, k, probs[j, k].clone(), q[j, k].clone()))
            return out, n_out

        runner._verify, runner._verify_probabilistic = verify, verify_probabilistic

    def summary(self, G: int) -> dict:
        reached, accepted, smin, qq, qx, ratio = (torch.zeros(G) for _ in range(6))
        for s in self.steps:
            for k in range(min(s["acc"] + 1, s["n"])):
                reached[k] += 1
                accepted[k] += k < s["acc"]
                smin[k] += s["smin"][k]
                qq[k] += s["qq"][k]
                qx[k] += s["qx"][k]
                ratio[k] += min(1.0, s["px"][k] / max(s["qx"][k], 1e-30))
        f = lambda t: [round(v, 4) for v in (t / reached.clamp(min=1)).tolist()]  # noqa: E731
        n_steps = len(self.steps)
        return {"steps": n_steps, "tau": round((sum(s["acc"] for s in self.steps) + n_steps) / max(1, n_steps), 4),
                "reached": reached.int().tolist(), "empirical_conditional_acceptance": f(accepted),
                "engine_sum_min_p_q": f(smin), "engine_E_min1_p_over_q_at_draft": f(ratio),
                "engine_E_q_of_x_under_q": f(qq), "engine_q_of_drafted_x": f(qx)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heldout")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=384, help="skip longer prompts (CPU time)")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=int, default=3000, help="(p, q) rows kept for the alignment")
    ap.add_argument("--no-evaluate", action="store_true",
                    help="skip the trainer's evaluate() and the whole-response teacher forcing (minutes)")
    ap.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args()
    t0 = time.time()
    drafter_dir = str(a.drafter or shipped_drafter(None))
    dcfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    G = dcfg["block_size"]
    ho = TokenData.load(a.heldout)
    prompts, ho_resp, ho_whole = [], [], []
    for i in range(len(ho)):
        t, m = ho.sequence(i)
        if int((~m).sum()) <= a.max_prompt and int(m.sum()) >= 2:
            prompts.append(t[~m].tolist())
            ho_resp.append(t[m].tolist()[:a.max_new])
            ho_whole.append(t[m].tolist()[:1024 - len(prompts[-1])])
        if len(prompts) == a.prompts:
            break
    res: dict = {"drafter": drafter_dir, "prompts": len(prompts), "max_new": a.max_new, "seed": a.seed}
    kw = dict(device="cpu", dtype="float32", max_model_len=a.max_prompt + a.max_new + 16, kv_cache_memory_gb=0.5,
              max_num_seqs=32, seed=a.seed, attention_backend="torch")
    sp = SamplingParams(temperature=1.0, max_tokens=a.max_new)

    # T = 1 continuations without speculation
    llm = LLM(**kw)
    plain = [o.token_ids for o in llm.generate(prompts, sp)]
    del llm
    print(f"[{time.time() - t0:.0f}s] plain T=1 generated", flush=True)

    # the engine's T = 1 DSpark run, instrumented
    spec = {"model": drafter_dir, "draft_sample_method": "probabilistic", "rejection_sample_method": "standard",
            "confidence_scheduling": False}  # every draft verified: the check is of the drafter's acceptance
    llm = LLM(speculative_config=spec, **kw)
    eng = llm.engine
    rec = Recorder(eng.runner, a.keep)
    outs = llm.generate(prompts, sp)
    spec_resp = {o.request_id: o.token_ids for o in outs}
    rid_prompt = {o.request_id: i for i, o in enumerate(outs)}
    st = eng.spec_stats.as_dict()
    res["engine_spec_stats"] = {"tau": st["spec_tau"], "conditional_acceptance": st["spec_conditional_acceptance"]}
    res["engine_verify_record"] = rec.summary(G)
    del llm
    print(f"[{time.time() - t0:.0f}s] spec T=1 run done", flush=True)

    tr, _ = trainer_with_drafter(drafter_dir, a.heldout)

    # the trainer's own held-out metric (its evaluate(): 64 sequences, whole responses, fixed anchors)
    if not a.no_evaluate:
        ev = tr.evaluate()
        res["trainer_evaluate_heldout"] = {k: ev[k] for k in ("heldout_tau_prob", "heldout_accept")}
        print(f"[{time.time() - t0:.0f}s] trainer evaluate: {res['trainer_evaluate_heldout']}", flush=True)
        res["teacher_forced_T0.7_heldout_whole"] = teacher_forced(tr, prompts, ho_whole, G)
        print(f"[{time.time() - t0:.0f}s] TF on T=0.7 whole: {res['teacher_forced_T0.7_heldout_whole']}", flush=True)
    res["teacher_forced_T0.7_heldout"] = teacher_forced(tr, prompts, ho_resp, G)
    print(f"[{time.time() - t0:.0f}s] TF on T=0.7: {res['teacher_forced_T0.7_heldout']}", flush=True)
    res["teacher_forced_T1_plain"] = teacher_forced(tr, prompts, plain, G)
    print(f"[{time.time() - t0:.0f}s] TF on T=1: {res['teacher_forced_T1_plain']}", flush=True)

    # alignment: the trainer's q and p at the engine's verify anchors of the spec run
    by_rid: dict[str, list] = {}
    for item in rec.kept:
        by_rid.setdefault(item[0], []).append(item)
    tv_q, tv_p, tr_acc, en_acc, n_k = (torch.zeros(G) for _ in range(5))
    skipped = far = 0
    for rid, items in by_rid.items():
        seq = prompts[rid_prompt[rid]] + spec_resp[rid]
        anchors = sorted({it[1] for it in items})
        col = {p: i for i, p in enumerate(anchors)}
        dl, tl = tf_logits(tr, seq, anchors, G)
        for _, anc, k, p_e, q_e in items:
            if anc + k >= len(seq):  # drafts accepted past a stop token: that context is not in the output
                skipped += 1
                continue
            q_t, p_t = dl[col[anc], k].softmax(-1), tl[col[anc], k].softmax(-1)
            far += bool(0.5 * (q_e - q_t).abs().sum() > 1e-3)
            tv_q[k] += 0.5 * (q_e - q_t).abs().sum()
            tv_p[k] += 0.5 * (p_e - p_t).abs().sum()
            tr_acc[k] += one_minus_tv(p_t, q_t)
            en_acc[k] += one_minus_tv(p_e, q_e)
            n_k[k] += 1
    f = lambda t: [float(f"{v:.3g}") for v in (t / n_k.clamp(min=1)).tolist()]  # noqa: E731
    res["aligned_at_engine_anchors"] = {"rows": n_k.int().tolist(), "TV_q_engine_vs_trainer": f(tv_q),
                                        "TV_p_engine_vs_trainer": f(tv_p), "trainer_one_minus_tv": f(tr_acc),
                                        "engine_sum_min_p_q": f(en_acc), "rows_TV_q_over_1e-3": far,
                                        "rows_skipped_past_stop": skipped}
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
