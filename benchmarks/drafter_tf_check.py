"""Teacher-forced acceptance of a drafter on the CPU, per slot, over the first MAX_NEW response tokens:
(a) the T = 0.7 regenerations of a held-out token file, (b) the target's own greedy continuations of
the same prompts (generated here). For each block slot: argmax agreement of draft and target, 1 − TV,
and the greedy chain τ = 1 + Σ_k ∏_{i≤k} [argmax agrees] over blocks with all labels (on greedy
continuations this is the engine's greedy τ, up to rounding). Written to answer why the trainer's
held-out τ_prob (anchors over whole responses) exceeds the engine's greedy τ (first 256 tokens).

    python benchmarks/drafter_tf_check.py HELDOUT.safetensors [--drafter DIR] [--prompts 32] [--max-new 192]
"""

from __future__ import annotations

import argparse
import glob
import json

import torch
from safetensors.torch import load_file

from dspark import LLM, SamplingParams
from dspark.drafters import shipped_drafter
from dspark.train.data import TokenData
from dspark.train.model import drafter_block_hidden, make_blocks, sample_anchors, target_forward
from dspark.train.trainer import TrainConfig, Trainer, make_batch, usable_sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heldout")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args()
    ho = TokenData.load(a.heldout)
    prompts = [ho.sequence(i)[0][~ho.sequence(i)[1]].tolist() for i in range(min(a.prompts, len(ho)))]
    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.5, max_num_seqs=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.max_new))
    greedy = TokenData.from_sequences(prompts, [o.token_ids for o in outs], {"split": "greedy"})
    del llm
    tr = Trainer(TrainConfig(out="/tmp/drafter_tf_check", data=a.heldout, model=None, device="cpu", batch_size=4,
                             seq_len=1024, anchors_per_seq=64))
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(a.drafter or shipped_drafter(None)) + "/*.safetensors")):
        sd.update(load_file(f))
    tr.drafter.load_state_dict_deepspec(sd, tr.target.embed_tokens.weight, tr.target.lm_head.weight_t)
    tr.drafter.float()
    G = tr.drafter.config.block_size

    @torch.no_grad()
    def measure(data: TokenData) -> dict:
        idx = usable_sequences(data, 1024)[:a.prompts]
        g = torch.Generator().manual_seed(0)
        match, tv, cnt, taus = torch.zeros(G), torch.zeros(G), torch.zeros(G), []
        for i in range(0, len(idx), 4):
            tokens, mask = make_batch(data, idx[i:i + 4], 1024, torch.device("cpu"))
            B, S = tokens.shape
            for b in range(B):  # the first max_new response tokens only
                pos = mask[b].nonzero().squeeze(1)
                if pos.numel() > a.max_new:
                    mask[b, pos[a.max_new]:] = False
            hidden, taps = target_forward(tr.target, tokens)
            anchors, valid = sample_anchors(mask, 64, g)
            blocks = make_blocks(tokens, mask, anchors, valid, G, tr.drafter.config.mask_token_id)
            h = drafter_block_hidden(tr.drafter, taps, blocks)
            K = anchors.shape[1]
            draft = tr.drafter.base_logits(h.reshape(-1, h.shape[-1])) + tr.drafter.markov_bias(blocks.prev.reshape(-1))
            rows = torch.arange(B)[:, None, None].expand(B, K, G).reshape(-1)
            target = tr.target.compute_logits(hidden[rows, blocks.positions.reshape(-1).clamp(max=S - 1)])
            lm = blocks.label_mask
            m = (draft.argmax(-1) == target.argmax(-1)).view(B, K, G) & lm
            one_tv = 1 - 0.5 * (draft.softmax(-1) - target.softmax(-1)).abs().sum(-1).view(B, K, G)
            match += (m.float() * lm).sum((0, 1))
            tv += (one_tv * lm).sum((0, 1))
            cnt += lm.float().sum((0, 1))
            taus.append((m.float().cumprod(-1).sum(-1) + 1)[lm.all(-1)])
        t = torch.cat(taus)
        return {"argmax_agreement": [round(x, 4) for x in (match / cnt).tolist()],
                "one_minus_tv": [round(x, 4) for x in (tv / cnt).tolist()],
                "greedy_chain_tau": round(t.mean().item(), 4), "blocks": int(t.numel())}

    res = {"max_new": a.max_new, "prompts": len(prompts), "sampled_T0.7": measure(ho), "greedy": measure(greedy)}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
