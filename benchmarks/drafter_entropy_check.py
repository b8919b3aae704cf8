"""Where does temperature-1 acceptance go? Teacher-forced 1 − TV(q, p) of a drafter, binned by the target's
entropy at the drafted position. CPU, fp32.

Issue 4's temperature-1 floor (τ ≥ 2.5) has stayed out of reach (τ 2.04-2.19) while greedy τ passed 3.0,
and neither more steps nor two more layers moved it (model card, session 38). This splits the held-out
acceptance of each token file by the target's entropy H(p) (nats) at the position being drafted: how much
of the text sits at each entropy, and how well the drafter matches p there. Then, for a T = 1 file against a
T 0.7 file, the counterfactual slot-1 acceptance "T = 1's entropy mix with the T 0.7 text's acceptance per
bin" says whether the drafter is worse at T = 1 text at equal entropy, or the text simply sits at higher
entropy, where every drafter matches p less well.

    python benchmarks/drafter_entropy_check.py T1.safetensors T07.safetensors [--drafter DIR]
        [--prompts 32] [--max-new 256] [--skip-layers 2,15,27] [--out FILE.json]

--skip-layers adds a reference for slot 1 that has everything a drafter lacks: the target itself with one
decoder layer removed (29 of its 30 layers, the anchor token processed, the whole context), predicting the
same tokens. How close such a near-copy of the target comes to p says how demanding a 1 − TV is.

The token files are the trainer's held-out files (`dspark train` writes them; session 38's are
heldout-s38-t1 / heldout-s38-t07 in .model/data/). Slot k of the block at anchor p drafts token p + k; every
anchor among a response's first --max-new tokens counts (as benchmarks/drafter_t1_check.py's teacher
forcing: the contexts are the file's own text).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from dspark.drafters import shipped_drafter
from dspark.train.data import TokenData

_spec = importlib.util.spec_from_file_location("drafter_t1_check", Path(__file__).with_name("drafter_t1_check.py"))
_t1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_t1)

BINS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, float("inf"))  # target entropy, nats


def responses(data: TokenData, n: int, max_new: int, max_prompt: int):
    """(prompt, response) token lists of the first n sequences with a prompt of at most max_prompt tokens
    and a response of at least 2 (cut to its first max_new tokens)."""
    used = 0
    for i in range(len(data)):
        t, m = data.sequence(i)
        if int((~m).sum()) > max_prompt or int(m.sum()) < 2:
            continue
        yield t[~m].tolist(), t[m].tolist()[:max_new]
        used += 1
        if used == n:
            return


def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp(min=1e-30).log()).sum(-1)


def collect(out: dict[str, list], used: int) -> dict:
    return {k: torch.cat(v) for k, v in out.items()} | {"sequences": used}


@torch.no_grad()
def rows(tr, data: TokenData, n: int, max_new: int, max_prompt: int, G: int) -> dict[str, torch.Tensor]:
    """Per (anchor, slot) with a label: slot index, target entropy, 1 − TV, target argmax agreement."""
    out: dict[str, list] = {"slot": [], "entropy": [], "acc": [], "agree": []}
    used = 0
    for prompt, resp in responses(data, n, max_new, max_prompt):
        seq = prompt + resp
        anchors = list(range(len(prompt), len(seq) - 1))
        dl, tl = _t1.tf_logits(tr, seq, anchors, G)  # [K, G, V]
        q, p = dl.softmax(-1), tl.softmax(-1)
        lab = (torch.tensor(anchors)[:, None] + torch.arange(1, G + 1)[None]) < len(seq)  # [K, G]
        out["slot"].append(torch.arange(G).expand_as(lab)[lab])
        out["entropy"].append(entropy(p)[lab])
        out["acc"].append(_t1.one_minus_tv(q, p)[lab])
        out["agree"].append((dl.argmax(-1) == tl.argmax(-1))[lab].float())
        used += 1
    return collect(out, used)


@torch.no_grad()
def skip_layer_rows(tr, data: TokenData, n: int, max_new: int, max_prompt: int, skip: int) -> dict[str, torch.Tensor]:
    """A reference for slot 1: the target with its decoder layer ``skip`` removed (the identity in its
    place), which sees everything the target sees, as the "drafter" of each response token: per token,
    the full target's entropy, 1 − TV(p_skip, p) and argmax agreement (rows as ``rows``'s slot 1)."""
    from dspark.train.model import target_forward

    target = tr.target
    out: dict[str, list] = {"entropy": [], "acc": [], "agree": []}
    used = 0
    for prompt, resp in responses(data, n, max_new, max_prompt):
        x, L = torch.tensor(prompt + resp)[None], len(prompt)
        # position j predicts token j + 1: the response's second token on (slot 1 of the anchor at j)
        lp = target.compute_logits(target_forward(target, x)[0][0, L:-1])
        layer = target.layers[skip]
        layer.forward = lambda h, *args: h  # an instance attribute: nn.Module.__call__ takes it
        try:
            ls = target.compute_logits(target_forward(target, x)[0][0, L:-1])
        finally:
            del layer.forward
        p = lp.softmax(-1)
        out["entropy"].append(entropy(p))
        out["acc"].append(_t1.one_minus_tv(ls.softmax(-1), p))
        out["agree"].append((ls.argmax(-1) == lp.argmax(-1)).float())
        used += 1
    r = collect(out, used)
    return r | {"slot": torch.zeros_like(r["acc"], dtype=torch.long)}


def summarise(r: dict, G: int) -> dict:
    tab = []
    s1 = r["slot"] == 0
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (r["entropy"] >= lo) & (r["entropy"] < hi)
        row = {"entropy": f"[{lo}, {hi})"}
        for name, mask in (("slot1", sel & s1), ("all_slots", sel)):
            cnt = int(mask.sum())
            row[name] = {"share": round(cnt / max(int((s1 if name == "slot1" else torch.ones_like(s1)).sum()), 1), 4),
                         "one_minus_tv": round(r["acc"][mask].mean().item(), 4) if cnt else None,
                         "argmax_agreement": round(r["agree"][mask].mean().item(), 4) if cnt else None}
        tab.append(row)
    per_slot = [round(r["acc"][r["slot"] == k].mean().item(), 4) for k in range(G)]
    return {"sequences": r["sequences"], "rows": int(r["slot"].numel()),
            "mean_entropy_slot1": round(r["entropy"][s1].mean().item(), 3),
            "one_minus_tv_per_slot": per_slot, "bins": tab}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="held-out token files (the first is compared with the others)")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--skip-layers", default="",
                    help="comma-separated target layers: for each, the target without it as a slot-1 reference")
    ap.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args()
    t0 = time.time()
    drafter_dir = str(a.drafter or shipped_drafter(None))
    tr, G = _t1.trainer_with_drafter(drafter_dir, a.files[0])
    res: dict = {"drafter": drafter_dir, "max_new": a.max_new, "files": {}}
    for f in a.files:
        data = TokenData.load(f)
        res["files"][f] = summarise(rows(tr, data, a.prompts, a.max_new, a.max_prompt, G), G)
        print(f"[{time.time() - t0:.0f}s] {f}: {json.dumps(res['files'][f]['one_minus_tv_per_slot'])}", flush=True)
        for skip in (int(x) for x in a.skip_layers.split(",") if x):
            ref = summarise(skip_layer_rows(tr, data, a.prompts, a.max_new, a.max_prompt, skip), 1)
            res["files"][f][f"target_without_layer_{skip}"] = ref
            print(f"[{time.time() - t0:.0f}s] {f}: the target without layer {skip}: slot 1 "
                  f"{ref['one_minus_tv_per_slot'][0]}", flush=True)
    # counterfactual slot-1 acceptance: the first file's entropy mix, each other file's acceptance per bin
    # (compare with the first file's own slot 1, one_minus_tv_per_slot[0])
    first = res["files"][a.files[0]]["bins"]
    for f in a.files[1:]:
        other = res["files"][f]["bins"]
        mix = sum(b["slot1"]["share"] * (o["slot1"]["one_minus_tv"] or 0.0) for b, o in zip(first, other))
        res["files"][f]["slot1_with_first_file_entropy_mix"] = round(mix, 4)
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
