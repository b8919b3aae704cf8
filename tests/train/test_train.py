"""Drafter training: losses against hand-computed values, anchors/blocks/attention mask on tiny
examples, the training forward == the engine's drafting forward, checkpoints (DeepSpec names,
shards), data (ShareGPT reader, held-out split, token files), and a smoke run on a tiny random
target whose drafter then serves in the engine losslessly."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from dspark import LLM, LLMEngine, SamplingParams
from dspark.config import ModelConfig
from dspark.engine.request import Request
from dspark.layers.attention import BatchLayout, context_slots
from dspark.models.dspark_drafter import DrafterConfig, drafter_config_dict, load_drafter, random_drafter_state_dict
from dspark.models.llama import LlamaForCausalLM
from dspark.models.loader import load_model
from dspark.sample.sampler import SamplingBatch
from dspark.train import data as data_mod
from dspark.train import trainer as trainer_mod
from dspark.train.checkpoint import drafter_state_dict, new_drafter, save_drafter
from dspark.train.cli import add_train_parser
from dspark.train.data import TokenData, generate_responses
from dspark.train.model import (block_attention_mask, draft_losses, drafter_block_hidden, expected_acceptance_length,
                                make_blocks, position_weights, sample_anchors, target_forward, training_forward)
from dspark.train.trainer import TrainConfig, Trainer, cosine_lr
from tests.conftest import write_tiny_checkpoint

MASK = 3
TAPS = [0, 2]


pytestmark = pytest.mark.usefixtures("one_thread_module")  # ~70x slower steps with contended threads


# ---------------------------------------------------------------------------------------- losses
def test_position_weights_and_cosine_schedule():
    assert torch.allclose(position_weights(4), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))
    lrs = [cosine_lr(s, 100, 0.04) for s in range(100)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # 4 warm-up steps
    assert lrs[4] == 1.0 and all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] < 1e-3


def test_losses_against_hand_computed_values():
    ln = math.log
    # Three labelled rows over V = 3: (block 0, slot 1), (block 0, slot 2), (block 1, slot 1); block 2 has none.
    draft = torch.tensor([[0.0, ln(2), 0.0], [0.0, 0.0, 0.0], [ln(3), 0.0, 0.0]])  # p_d [¼ ½ ¼], ⅓s, [⅗ ⅕ ⅕]
    target = torch.tensor([[ln(2), 0.0, 0.0], [0.0, 0.0, 100.0], [ln(3), 0.0, 0.0]])  # p_t: [½ ¼ ¼], e3, = p_d
    conf = torch.tensor([0.0, 1.0, -1.0])
    labels = torch.tensor([1, 2, 0])
    out = draft_losses(draft, target, conf, labels, slot=torch.tensor([0, 1, 0]), block=torch.tensor([0, 0, 1]),
                       num_blocks=3, block_size=2)
    w = [1.0, math.exp(-0.25), 1.0]
    W = sum(w)
    ce = [ln(2), ln(3), ln(5 / 3)]
    l1 = [0.5, 4 / 3, 0.0]
    soft = [0.75, 1 / 3, 1.0]

    def bce(x: float, y: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return -(y * ln(s) + (1 - y) * ln(1 - s))

    exp_ce = sum(a * b for a, b in zip(w, ce)) / W
    exp_tv = sum(a * b for a, b in zip(w, l1)) / W
    exp_conf = sum(a * bce(x, y) for a, x, y in zip(w, [0.0, 1.0, -1.0], soft)) / W
    assert out.ce.item() == pytest.approx(exp_ce, rel=1e-5)
    assert out.tv.item() == pytest.approx(exp_tv, rel=1e-5)
    assert out.conf.item() == pytest.approx(exp_conf, rel=1e-5)
    assert out.total.item() == pytest.approx(0.1 * exp_ce + 0.9 * exp_tv + 1.0 * exp_conf, rel=1e-5)
    # τ_prob: block 0: 1 + .75 + .75·⅓ = 2; block 1: 1 + 1 + 0 = 2; block 2 (no rows) is not counted.
    assert out.tau_prob.item() == pytest.approx(2.0)
    assert out.accept.tolist() == pytest.approx([0.875, 1 / 3])
    assert out.num_rows == 3


def test_losses_gradients_flow_to_draft_and_confidence_only():
    draft = torch.randn(4, 5, requires_grad=True)
    conf = torch.randn(4, requires_grad=True)
    target = torch.randn(4, 5)
    out = draft_losses(draft, target, conf, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 0]),
                       torch.tensor([0, 0, 0, 1]), 2, 3)
    out.total.backward()
    assert draft.grad.abs().sum() > 0 and conf.grad.abs().sum() > 0
    # The confidence label is detached: the BCE alone sends nothing into the draft logits.
    d2 = draft.detach().clone().requires_grad_(True)
    c2 = conf.detach().clone().requires_grad_(True)
    draft_losses(d2, target, c2, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 0]),
                 torch.tensor([0, 0, 0, 1]), 2, 3).conf.backward()
    assert d2.grad is None or d2.grad.abs().sum() == 0


def test_expected_acceptance_length():
    acc = torch.tensor([[0.5, 0.5, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert expected_acceptance_length(acc).tolist() == [1.75, 4.0, 1.0]


# ---------------------------------------------------------------------------------------- blocks
def test_anchors_are_response_positions_followed_by_a_response_token():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)  # anchors possible at 2, 3, 6
    a, v = sample_anchors(mask, 5, torch.Generator().manual_seed(0))
    assert a.shape == (1, 5) and a[0, :3].tolist() == [2, 3, 6] and v[0].tolist() == [True] * 3 + [False] * 2
    for seed in range(10):
        a, v = sample_anchors(mask, 2, torch.Generator().manual_seed(seed))
        assert v.all() and a[0, 0] < a[0, 1] and set(a[0].tolist()) <= {2, 3, 6}


def test_blocks_labels_and_markov_previous_tokens():
    tokens = torch.arange(10, 18)[None]  # x_j = 10 + j
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    b = make_blocks(tokens, mask, torch.tensor([[3, 5, 6]]), torch.ones(1, 3, dtype=torch.bool), 3, MASK)
    assert b.tokens[0].tolist() == [[13, MASK, MASK], [15, MASK, MASK], [16, MASK, MASK]]
    assert b.positions[0].tolist() == [[3, 4, 5], [5, 6, 7], [6, 7, 8]]
    assert b.label_mask[0].tolist() == [[True] * 3, [True, True, False], [True, False, False]]
    assert b.labels[0].tolist() == [[14, 15, 16], [16, 17, 0], [17, 0, 0]]
    assert b.prev[0].tolist() == [[13, 14, 15], [15, 16, 0], [16, 0, 0]]  # teacher forcing: the true x_{p+k-1}
    # A hole in the loss mask ends the labels: a contiguous prefix.
    holed = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    b = make_blocks(tokens, holed, torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool), 3, MASK)
    assert b.label_mask[0].tolist() == [[True, False, False]]


def test_block_attention_mask_sees_earlier_context_and_its_own_block():
    m = block_attention_mask(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), seq_len=7, block_size=2)
    ctx0, ctx1 = [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]
    expected = [ctx0 + [1, 1, 0, 0], ctx0 + [1, 1, 0, 0], ctx1 + [0, 0, 1, 1], ctx1 + [0, 0, 1, 1]]
    assert m[0].int().tolist() == expected
    # A padding anchor attends only to its own block.
    m = block_attention_mask(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), seq_len=7, block_size=2)
    assert m[0, 2].int().tolist() == [0] * 7 + [0, 0, 1, 1]


# ---------------------------------------------------------------------------------------- tiny target
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("train") / "target", "llama", seed=5, vocab_size=256,
                                 num_hidden_layers=4, hidden_size=64, intermediate_size=128)


def _drafter_cfg(target, **kw) -> dict:
    mc = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    kw = {"num_hidden_layers": 2, "block_size": 4, "mask_token_id": MASK, "target_layer_ids": TAPS,
          "markov_rank": 8, **kw}
    return drafter_config_dict(mc, **kw)


def _training_models(target, cfg: dict, sd: dict) -> tuple[LlamaForCausalLM, object]:
    loaded = load_model(str(target), torch.float32, "cpu")
    model = LlamaForCausalLM(loaded.config, 256, tuple(TAPS))
    model.load_hf_state_dict(loaded.state_dict)
    model.eval().requires_grad_(False)
    d = new_drafter(DrafterConfig.from_dict(cfg), model, 256, 0, "cpu")
    d.load_state_dict_deepspec(sd, model.embed_tokens.weight, model.lm_head.weight_t)
    return model, d


@torch.inference_mode()
def _engine_block(llm: LLM, tokens: list[int], p: int, num_slots: int):
    """The engine's drafting at anchor p: prefill x_0..x_{p-1} through the paged target, write the
    drafter context (DSparkProposer.write_context), then block_hidden over [x_p, mask, ...] at
    positions p.. -> (taps [p, m·H], base logits [γ, V], greedy proposal [γ], confidence [γ])."""
    eng = llm.engine
    runner, kv, prop = eng.runner, eng.kv, eng.runner.proposer
    r = Request("__ctx__", tokens[:p], SamplingParams(), 0, ())
    assert kv.allocate_slots(r, p)
    try:
        bs = kv.block_size
        bt = torch.tensor([kv.block_ids(r.request_id)])
        pos = torch.arange(p)
        layout = BatchLayout(pos, bt[0, pos // bs] * bs + pos % bs, [0, p], [p], bt, bs)
        _, taps = runner.model(torch.tensor(tokens[:p]), pos, runner.backend, runner.backend.prepare(layout),
                               runner.kv_caches)
        prop.write_context(taps, pos, layout.slot_mapping)
        slots, valid = context_slots(bt, torch.tensor([p]), bs)
        ctx = [(prop.kv[i, 0].view(-1, *prop.kv.shape[-2:])[slots], prop.kv[i, 1].view(-1, *prop.kv.shape[-2:])[slots])
               for i in range(len(prop.drafter.layers))]
        anchor, apos = torch.tensor([tokens[p]]), torch.tensor([p])
        h = prop.drafter.block_hidden(anchor, apos, ctx, valid, num_slots)
        batch = SamplingBatch.build([SamplingParams(temperature=0)], [0], [p + 1], [tokens[:p]], [[]], 256, "cpu")
        proposal = prop.propose([r], anchor, apos, bt, num_slots, batch, [False])
        return taps, prop.drafter.base_logits(h)[0], proposal.tokens[0], proposal.confidence[0]
    finally:
        kv.free(r)


def test_training_forward_equals_engine_drafting(target, tmp_path):
    """What is trained is what is served: for the same target, drafter weights and anchor, the training
    forward's taps, base logits, first Markov-corrected draft and confidence equal the engine's."""
    cfg = _drafter_cfg(target)
    sd = random_drafter_state_dict(DrafterConfig.from_dict(cfg), seed=1, std=0.2)
    model, drafter = _training_models(target, cfg, sd)
    # Through the training checkpoint path: DeepSpec names, several fp32 shards, loaded by the engine.
    files = save_drafter(tmp_path / "d", cfg, drafter_state_dict(drafter), torch.float32, max_shard_bytes=40_000)
    assert len([f for f in files if f.suffix == ".safetensors"]) > 2
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64,
              speculative_config={"model": str(tmp_path / "d")})

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 256, (1, 30), generator=g)
    mask = torch.zeros(1, 30, dtype=torch.bool)
    mask[0, 9:] = True
    anchors = torch.tensor([[9, 14, 21, 26]])
    G = cfg["block_size"]
    with torch.no_grad():
        hidden, taps = target_forward(model, tokens)
        blocks = make_blocks(tokens, mask, anchors, torch.ones_like(anchors, dtype=torch.bool), G, MASK)
        h = drafter_block_hidden(drafter, taps, blocks)  # [1, K·γ, H]
        U = drafter.base_logits(h).view(4, G, -1)
        hs = h.view(4, G, -1)
    for i, p in enumerate(anchors[0].tolist()):
        e_taps, e_U, e_tok, e_conf = _engine_block(llm, tokens[0].tolist(), p, G)
        assert torch.allclose(taps[0, :p], e_taps, atol=1e-4)
        assert torch.allclose(U[i], e_U, atol=1e-4), (U[i] - e_U).abs().max()
        x_p = tokens[0, p:p + 1]
        first = (U[i, 0] + drafter.markov_bias(x_p)[0]).argmax()  # slot 1: the previous token is the anchor
        assert e_tok[0] == first
        c1 = torch.sigmoid(drafter.confidence_logit(hs[i, :1], x_p))
        assert torch.allclose(c1, e_conf[:1], atol=1e-5)


def test_checkpoint_round_trip_and_shard_limit(target, tmp_path):
    cfg = _drafter_cfg(target, markov_rank=16)
    sd = random_drafter_state_dict(DrafterConfig.from_dict(cfg), seed=2)
    model, drafter = _training_models(target, cfg, sd)
    out = drafter_state_dict(drafter)
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)  # exact inverse of the loader
    save_drafter(tmp_path / "one", cfg, out, torch.float32)
    save_drafter(tmp_path / "many", cfg, out, torch.float32, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    assert all(f.stat().st_size <= 40_000 + 2_000 for f in (tmp_path / "many").glob("*.safetensors"))
    mc = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    for d in ("one", "many"):
        loaded, _ = load_drafter(tmp_path / d, mc, model.embed_tokens, model.lm_head, 64, torch.float32,
                                 torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), drafter.parameters()))
    save_drafter(tmp_path / "one", cfg, out, torch.float32, max_shard_bytes=40_000)  # stale single file removed
    assert not (tmp_path / "one" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="shard limit"):
        save_drafter(tmp_path / "x", cfg, out, torch.float32, max_shard_bytes=1_000)


# ---------------------------------------------------------------------------------------- data
def test_sharegpt_reader_survives_a_truncated_file():
    text = '[\n {"id": "a_0", "conversations": [{"from": "human", "value": "hi"}]},\n {"id": "b_0", "conv'
    assert data_mod.read_json_array_prefix(text) == [{"id": "a_0", "conversations": [{"from": "human", "value": "hi"}]}]
    assert data_mod.read_json_array_prefix('[{"x": 1}, {"x": 2}]') == [{"x": 1}, {"x": 2}]


def test_heldout_split_is_by_conversation_and_about_five_percent():
    ids = [f"conv{i}" for i in range(20_000)]
    frac = sum(map(data_mod.is_heldout, ids)) / len(ids)
    assert 0.04 < frac < 0.06
    assert all(data_mod.is_heldout(f"{c}_{k}") == data_mod.is_heldout(c) for c in ids[:500] for k in (0, 3, 11))
    held = next(c for c in ids if data_mod.is_heldout(c))
    trained = next(c for c in ids if not data_mod.is_heldout(c))
    recs = [{"id": f"{held}_0", "conversations": [{"from": "human", "value": "same"}]},
            {"id": f"{trained}_0",
             "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "same"}]},
            {"id": f"{trained}_1", "conversations": [{"from": "human", "value": " other "}]}]
    split = data_mod.split_prompts(recs)
    assert split.heldout == ("same",) and split.train == ("other",)  # a held-out text is never trained on


def test_sharegpt_package_split():
    split = data_mod.load_prompt_split()
    assert len(split.train) > 10_000 and 0.04 < len(split.heldout) / (len(split.train) + len(split.heldout)) < 0.06
    assert not set(split.heldout) & set(split.train)
    assert data_mod.heldout_prompts(5) == list(split.heldout[:5])
    assert data_mod.train_prompts(5, seed=1) == data_mod.train_prompts(10, seed=1)[:5]


@pytest.fixture(scope="module")
def token_files(target, tmp_path_factory):
    """Responses regenerated by the tiny target for random prompts (the same path as ShareGPT's)."""
    root = tmp_path_factory.mktemp("data")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (int(n),), generator=g).tolist() for n in torch.randint(6, 20, (30,), generator=g)]
    engine = LLMEngine(str(target), device="cpu", seed=0)
    responses = generate_responses(engine, prompts, max_tokens=48, seed=0)
    assert all(len(r) > 0 for r in responses) and not engine.requests
    TokenData.from_sequences(prompts[:24], responses[:24], {"split": "train"}).save(root / "train.safetensors")
    TokenData.from_sequences(prompts[24:], responses[24:], {"split": "heldout"}).save(root / "heldout.safetensors")
    return root / "train.safetensors", root / "heldout.safetensors", prompts


def test_token_file_round_trip(token_files):
    d = TokenData.load(token_files[0])
    prompts = token_files[2]
    toks, mask = d.sequence(0)
    n = len(prompts[0])
    assert toks[:n].tolist() == prompts[0] and not mask[:n].any() and mask[n:].all()
    assert d.meta["split"] == "train" and d.meta["num_sequences"] == len(d)


def test_token_files_of_several_sessions_concatenate(token_files, target, tmp_path):
    a, b = TokenData.load(token_files[0]), TokenData.load(token_files[1])
    both = TokenData.load_many(f"{token_files[0]},{token_files[1]}")
    assert len(both) == len(a) + len(b) and both.meta["num_sequences"] == len(both)
    for i in range(len(a)):
        assert all(torch.equal(x, y) for x, y in zip(both.sequence(i), a.sequence(i)))
    for i in range(len(b)):
        assert all(torch.equal(x, y) for x, y in zip(both.sequence(len(a) + i), b.sequence(i)))
    assert [p["split"] for p in both.meta["parts"]] == ["train", "heldout"]
    # the trainer reads a comma-separated list
    tr = Trainer(_cfg(target, token_files, tmp_path / "run", data=f"{token_files[0]},{token_files[1]}", steps=1))
    assert len(tr.data) == len(both)


def test_generation_time_budget_keeps_partial_responses(target):
    engine = LLMEngine(str(target), device="cpu", max_num_seqs=2, seed=0)
    out = generate_responses(engine, [[5, 6, 7]] * 4, max_tokens=500, time_budget_s=0.3)
    assert len(out) == 4 and any(0 < len(r) < 500 for r in out) and not engine.requests


def test_generation_passes_sample_new_responses_to_the_same_prompts(target, tmp_path, monkeypatch):
    src = tmp_path / "split.json"
    src.write_text(json.dumps({"train": ["a", "b", "c"], "heldout": ["h"]}))
    # the tiny target has no tokenizer: each prompt text becomes fixed ids
    monkeypatch.setattr(data_mod, "chat_prompt_ids",
                        lambda engine, texts, n: [[5 + ord(t[0]) % 50, 6, 7, 8] for t in texts])
    out = tmp_path / "train.safetensors"
    s = data_mod.build_datasets(str(target), out, None, num_prompts=3, num_heldout_prompts=0, max_tokens=24,
                                max_prompt_tokens=16, device="cpu", prompt_source=str(src), passes=2)
    d = TokenData.load(out)
    assert s["train"]["passes"] == 2 and len(d) == 6
    first, second = [[d.sequence(i)[0].tolist() for i in r] for r in (range(3), range(3, 6))]
    assert [x[:4] for x in first] == [x[:4] for x in second]  # the same prompts, in the same order
    assert all(a != b for a, b in zip(first, second))  # new seeds: new responses
    with pytest.raises(ValueError, match="passes"):
        data_mod.build_datasets(str(target), out, None, num_prompts=3, num_heldout_prompts=0, max_tokens=4,
                                max_prompt_tokens=16, device="cpu", prompt_source=str(src), passes=0)


def test_sharded_regeneration_splits_the_unsharded_requests(target, tmp_path, monkeypatch):
    """shard=(k, n): n processes regenerate between them exactly the unsharded run's requests (same
    prompts, same seeds, so the same responses); only shard 0 writes the held-out file."""
    src = tmp_path / "split.json"
    src.write_text(json.dumps({"train": ["a", "b", "c", "d", "e"], "heldout": ["h", "i"]}))
    monkeypatch.setattr(data_mod, "chat_prompt_ids",
                        lambda engine, texts, n: [[5 + ord(t[0]) % 50, 6, 7, 8] for t in texts])
    kw = dict(num_prompts=5, num_heldout_prompts=2, max_tokens=10, max_prompt_tokens=16, device="cpu",
              prompt_source=str(src), passes=2, sampling="t1")

    def seqs(path):
        d = TokenData.load(path)
        return [d.sequence(i)[0].tolist() for i in range(len(d))]

    data_mod.build_datasets(str(target), tmp_path / "all.st", tmp_path / "all-ho.st", **kw)
    for k in range(3):
        s = data_mod.build_datasets(str(target), tmp_path / f"s{k}.st", tmp_path / f"s{k}-ho.st", shard=(k, 3), **kw)
        assert s["train"]["shard"] == [k, 3]
        assert (tmp_path / f"s{k}-ho.st").is_file() == (k == 0)
    whole = seqs(tmp_path / "all.st")
    assert len(whole) == 10 and len(set(map(tuple, whole))) == 10
    assert [seqs(tmp_path / f"s{k}.st") for k in range(3)] == [whole[k::3] for k in range(3)]
    assert seqs(tmp_path / "s0-ho.st") == seqs(tmp_path / "all-ho.st")
    with pytest.raises(ValueError, match="shard"):
        data_mod.build_datasets(str(target), tmp_path / "x.st", None, shard=(3, 3), **kw)


def test_regeneration_sampling_presets_and_json(target, tmp_path, monkeypatch):
    """--gen-sampling: the settings reach every request and the token file's meta; temperature 0 gives
    the target's greedy continuations; bad specs name the problem."""
    from dspark import LLM, SamplingParams

    assert data_mod.gen_sampling(None) == data_mod.GEN_SAMPLING
    assert data_mod.gen_sampling("t1") == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert data_mod.gen_sampling('{"temperature": 0.9, "min_p": 0.1}') == {"temperature": 0.9, "min_p": 0.1}
    for bad in ("hot", '{"seed": 3}', "[1]", "{}"):
        with pytest.raises(ValueError, match="gen-sampling"):
            data_mod.gen_sampling(bad)
    src = tmp_path / "split.json"
    src.write_text(json.dumps({"train": ["a", "b"], "heldout": []}))
    monkeypatch.setattr(data_mod, "chat_prompt_ids",
                        lambda engine, texts, n: [[5 + ord(t[0]) % 50, 6, 7, 8] for t in texts])
    out = tmp_path / "greedy.safetensors"
    s = data_mod.build_datasets(str(target), out, None, num_prompts=2, num_heldout_prompts=0, max_tokens=12,
                                max_prompt_tokens=16, device="cpu", prompt_source=str(src),
                                sampling='{"temperature": 0}')
    assert s["train"]["sampling"] == {"temperature": 0}
    d = TokenData.load(out)
    prompts = [d.sequence(i)[0][~d.sequence(i)[1]].tolist() for i in range(len(d))]
    want = LLM(str(target), device="cpu").generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [d.sequence(i)[0][d.sequence(i)[1]].tolist() for i in range(len(d))] == [o.token_ids for o in want]


# ---------------------------------------------------------------------------------------- training
def _cfg(target, token_files, out, **kw) -> TrainConfig:
    base = dict(out=str(out), data=str(token_files[0]), eval_data=str(token_files[1]), model=str(target),
                block_size=4, num_layers=1, markov_rank=8, target_layer_ids=TAPS, mask_token_id=MASK, steps=40,
                batch_size=4, seq_len=64, anchors_per_seq=16, lr=3e-3, eval_every=20, eval_seqs=6, save_every=0,
                log_every=1, save_dtype="float32", device="cpu")
    return TrainConfig(**{**base, **kw})


def test_smoke_training_loss_decreases_and_drafter_serves_losslessly(target, token_files, tmp_path):
    out = tmp_path / "run"
    final = Trainer(_cfg(target, token_files, out, steps=60)).train()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    evals = [r["heldout_tau_prob"] for r in log if "heldout_tau_prob" in r]
    assert len(evals) == 4 and evals[0] == log[0]["heldout_tau_prob"]  # step 0, 20, 40, final
    assert final["heldout_tau_prob"] == evals[-1] > evals[0] and len(final["heldout_accept"]) == 4
    cfg = json.loads((out / "train_config.json").read_text())
    assert cfg["lr"] == 3e-3 and cfg["drafter_config"]["target_layer_ids"] == TAPS and cfg["steps_done"] == 60
    assert (out / "trainer_state.pt").is_file() and (out / "drafter" / "config.json").is_file()

    prompts = token_files[2][24:]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(target), device="cpu").generate(prompts, greedy)]
    spec = LLM(str(target), device="cpu", speculative_config={"model": str(out / "drafter")})
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == ref
    assert spec.engine.spec_stats.num_steps > 0


def test_several_heldout_files_are_evaluated_each(target, token_files, tmp_path):
    """eval_data "a,b": heldout_* is file a's (the same figures as with a alone), heldout1_* file b's."""
    one = Trainer(_cfg(target, token_files, tmp_path / "a", steps=2)).evaluate()
    two = Trainer(_cfg(target, token_files, tmp_path / "b", steps=2,
                       eval_data=f"{token_files[1]},{token_files[0]}")).evaluate()
    assert {k: v for k, v in two.items() if k.startswith("heldout_")} == one
    assert set(two) == set(one) | {k.replace("heldout_", "heldout1_") for k in one}
    assert two["heldout1_tau_prob"] != two["heldout_tau_prob"]  # another file, other sequences


def test_resume_after_interrupt_matches_an_uninterrupted_run(target, token_files, tmp_path, monkeypatch):
    full = Trainer(_cfg(target, token_files, tmp_path / "a", steps=12, eval_data=None))
    full.train()
    calls = {"n": 0}
    real = trainer_mod.training_forward

    def interrupt_at_step_7(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "training_forward", interrupt_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_cfg(target, token_files, tmp_path / "b", steps=12, eval_data=None)).train()
    monkeypatch.undo()
    assert torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=True)["step"] == 7
    resumed = Trainer(_cfg(target, token_files, tmp_path / "b", steps=12, eval_data=None, resume=True))
    resumed.train()
    a, b = drafter_state_dict(full.drafter), drafter_state_dict(resumed.drafter)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_warm_restart_starts_a_new_schedule_from_the_checkpoint(target, token_files, tmp_path):
    out = tmp_path / "run"
    first = Trainer(_cfg(target, token_files, out, steps=6, eval_data=None))
    first.train()
    w_first = drafter_state_dict(first.drafter)
    batches_first = [first._train_loss(s).tau_prob.item() for s in range(2)]
    again = Trainer(_cfg(target, token_files, out, steps=6, eval_data=None, resume=True, restart_steps=5, lr=1e-3))
    again._resume()  # weights and Adam moments of the checkpoint, a fresh schedule
    assert (again.step, again.total_steps, again.schedule) == (0, 5, 1)
    assert all(torch.equal(w_first[k], v) for k, v in drafter_state_dict(again.drafter).items())
    assert [again._train_loss(s).tau_prob.item() for s in range(2)] != batches_first  # new batches
    rest = Trainer(_cfg(target, token_files, out, steps=6, eval_data=None, resume=True, restart_steps=5))
    final = rest.train()
    assert final["steps"] == 5 and final["total_steps"] == 5
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("warm_restart") == 1 for r in log)
    lrs = [r["lr"] for r in log if "loss" in r][-5:]  # the new schedule from its start
    assert lrs == pytest.approx([3e-3 * cosine_lr(s, 5, 0.04) for s in range(5)])
    state = torch.load(out / "trainer_state.pt", weights_only=True)
    assert (state["step"], state["total_steps"], state["schedule"]) == (5, 5, 1)
    with pytest.raises(ValueError, match="restart_steps"):
        Trainer(_cfg(target, token_files, out, eval_data=None, resume=True, restart_steps=0))._resume()


def test_padding_changes_no_loss(target, token_files, tmp_path):
    """make_batch rounds the batch length up to a multiple of SEQ_BUCKET (few distinct shapes for the
    GPU's attention/GEMM plans); the padded batch gives the unpadded one's anchors, losses and τ_prob."""
    tr = Trainer(_cfg(target, token_files, tmp_path / "run", steps=1, eval_data=None, seq_len=128))
    idx = tr.train_idx[:4]
    tokens, mask = trainer_mod.make_batch(tr.data, idx, 128, tr.device)
    n = max(tr.data.sequence(i)[0].numel() for i in idx)
    assert tokens.shape[1] % trainer_mod.SEQ_BUCKET == 0 and n < tokens.shape[1] < n + trainer_mod.SEQ_BUCKET
    assert trainer_mod.make_batch(tr.data, idx, n - 3, tr.device)[0].shape[1] == n - 3  # never past seq_len
    with torch.no_grad():
        a, b = (training_forward(tr.target, tr.drafter, t, m, 16, torch.Generator().manual_seed(3))
                for t, m in ((tokens, mask), (tokens[:, :n], mask[:, :n])))
    assert a.num_rows == b.num_rows > 0
    for x, y in ((a.total, b.total), (a.tau_prob, b.tau_prob), (a.accept, b.accept)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_init_from_a_trained_drafter(target, token_files, tmp_path):
    """A later session goes on training a saved drafter (no trainer_state.pt there): same weights at
    step 0, fresh optimizer; a drafter of another shape is refused with the differing fields."""
    first = Trainer(_cfg(target, token_files, tmp_path / "a", steps=4, eval_data=None))
    first.train()
    again = Trainer(_cfg(target, token_files, tmp_path / "b", steps=2, eval_data=None,
                         init_from=str(tmp_path / "a" / "drafter")))
    want, got = drafter_state_dict(first.drafter), drafter_state_dict(again.drafter)
    assert all(torch.equal(want[k], got[k]) for k in want)  # float32 export: exact
    assert again.step == 0 and not again.opt.state
    assert all(p.requires_grad for p in again.params) and len(again.params) == len(first.params)
    again.train()
    assert not torch.equal(drafter_state_dict(again.drafter)["fc.weight"], want["fc.weight"])
    with pytest.raises(ValueError, match="markov_rank"):
        Trainer(_cfg(target, token_files, tmp_path / "c", markov_rank=4, eval_data=None,
                     init_from=str(tmp_path / "a" / "drafter")))


def test_init_from_another_block_size(target, token_files, tmp_path):
    """A drafter trained at one block size starts a run at another (no parameter depends on it): every
    tensor carried over, the new run drafts and labels its own block size, and the export says so."""
    first = Trainer(_cfg(target, token_files, tmp_path / "a", steps=4, eval_data=None, block_size=3))
    first.train()
    longer = Trainer(_cfg(target, token_files, tmp_path / "b", steps=2, eval_data=None, block_size=5,
                          init_from=str(tmp_path / "a" / "drafter")))
    want, got = drafter_state_dict(first.drafter), drafter_state_dict(longer.drafter)
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    with torch.no_grad():
        assert len(first._train_loss(0).accept) == 3 and len(longer._train_loss(0).accept) == 5
    longer.train()
    assert json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())["block_size"] == 5


def test_init_from_grows_a_deeper_drafter(target, token_files, tmp_path):
    """A deeper drafter grown from a trained one (``init_from`` with more layers): the trained layers
    first, the new ones starting as the identity (residual-branch outputs zero), so the grown drafter
    gives the trained one's loss on the same batch; training then moves the new layers. Fewer layers
    than the checkpoint is refused."""
    first = Trainer(_cfg(target, token_files, tmp_path / "a", steps=4, eval_data=None, num_layers=1))
    first.train()
    src = str(tmp_path / "a" / "drafter")
    grown = Trainer(_cfg(target, token_files, tmp_path / "b", steps=3, eval_data=None, num_layers=3, init_from=src))
    want, got = drafter_state_dict(first.drafter), drafter_state_dict(grown.drafter)
    assert all(torch.equal(want[k], got[k]) for k in want)  # every trained tensor carried over
    for i in (1, 2):
        assert not got[f"layers.{i}.self_attn.o_proj.weight"].any() and not got[f"layers.{i}.mlp.down_proj.weight"].any()
        assert got[f"layers.{i}.self_attn.q_proj.weight"].any()  # the rest of a new layer keeps its random init
    with torch.no_grad():
        a, b = first._train_loss(0), grown._train_loss(0)
    assert abs(a.total.item() - b.total.item()) < 1e-5 and abs(a.tau_prob.item() - b.tau_prob.item()) < 1e-5
    grown.train()
    assert drafter_state_dict(grown.drafter)["layers.2.mlp.down_proj.weight"].any()
    with pytest.raises(ValueError, match="only growing"):
        Trainer(_cfg(target, token_files, tmp_path / "c", eval_data=None, num_layers=1,
                     init_from=str(tmp_path / "b" / "drafter")))


def test_init_from_adds_taps(target, token_files, tmp_path):
    """A drafter that taps more target layers, started from a trained one (``init_from`` with a superset of
    its ``target_layer_ids``): each trained tap's block of fc's columns moves to its new place, the new taps'
    columns start at zero, so the loss on the same batch is the trained drafter's; training then uses the
    new taps. Dropping a tap is refused."""
    first = Trainer(_cfg(target, token_files, tmp_path / "a", steps=4, eval_data=None))  # TAPS = [0, 2] of 4 layers
    # (the last layer, 3, cannot be tapped: HF returns its output normalised)
    first.train()
    src = str(tmp_path / "a" / "drafter")
    more = Trainer(_cfg(target, token_files, tmp_path / "b", steps=3, eval_data=None, target_layer_ids=[0, 1, 2],
                        init_from=src))
    want, got = drafter_state_dict(first.drafter), drafter_state_dict(more.drafter)
    assert all(torch.equal(want[k], got[k]) for k in want if k != "fc.weight")
    H = want["fc.weight"].shape[0]
    fc = got["fc.weight"]
    assert fc.shape == (H, 3 * H)
    assert torch.equal(fc[:, :H], want["fc.weight"][:, :H]) and torch.equal(fc[:, 2 * H:3 * H], want["fc.weight"][:, H:])
    assert not fc[:, H:2 * H].any()
    with torch.no_grad():
        a, b = first._train_loss(0), more._train_loss(0)
    assert abs(a.total.item() - b.total.item()) < 1e-5 and abs(a.tau_prob.item() - b.tau_prob.item()) < 1e-5
    more.train()
    assert drafter_state_dict(more.drafter)["fc.weight"][:, H:2 * H].any()
    assert json.loads((tmp_path / "b" / "drafter" / "config.json").read_text())["target_layer_ids"] == [0, 1, 2]
    with pytest.raises(ValueError, match="only adding taps"):
        Trainer(_cfg(target, token_files, tmp_path / "c", eval_data=None, target_layer_ids=[0], init_from=src))


def test_time_budget_refits_the_step_count_from_real_steps(target, token_files, tmp_path, monkeypatch):
    """The planner's estimate is replaced at each REPLANS step by one from the measured pace of the real
    steps since its window began; a split run (stop_after_s, then resume) keeps the schedule."""
    monkeypatch.setattr(trainer_mod, "REPLANS", ((2, 4), (6, 10)))
    planned = {}
    real_plan = Trainer._plan_steps

    def plan_too_few(self, budget_s):  # as if the timing passes were 20x too slow
        planned["n"] = real_plan(self, budget_s)
        return max(5, planned["n"] // 20)

    monkeypatch.setattr(Trainer, "_plan_steps", plan_too_few)
    out = tmp_path / "run"
    final = Trainer(_cfg(target, token_files, out, steps=10_000, time_budget_s=8.0, eval_data=None)).train()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    replan = [r for r in log if "replanned_total_steps" in r]
    assert [r["step"] for r in replan] == [4, 10]
    assert final["total_steps"] == replan[-1]["replanned_total_steps"] > max(5, planned["n"] // 20)
    assert final["steps"] >= 0.5 * final["total_steps"]  # the budget fits (loosely: the pace is noisy)

    # stop_after_s ends a call early with a checkpoint; resume finishes the same schedule
    monkeypatch.undo()
    out2 = tmp_path / "split"
    first = Trainer(_cfg(target, token_files, out2, steps=30, stop_after_s=0.0, eval_data=None)).train()
    assert first["steps"] == 0 and first["stopped_at_time_budget"]
    done = Trainer(_cfg(target, token_files, out2, steps=999, resume=True, eval_data=None)).train()
    assert done["steps"] == done["total_steps"] == 30


def test_train_cli_records_the_command(target, token_files, tmp_path):
    p = argparse.ArgumentParser()
    add_train_parser(p.add_subparsers(dest="command"))
    args = ["train", "--model", str(target), "--out", str(tmp_path / "o"), "--data", str(token_files[0]),
            "--eval-data", "none", "--steps", "3", "--batch-size", "2", "--seq-len", "48", "--anchors-per-seq", "4",
            "--block-size", "3", "--num-layers", "1", "--markov-rank", "4", "--target-layer-ids", "1,2",
            "--mask-token-id", "3", "--device", "cpu"]
    a = p.parse_args(args)
    assert a.func(a) == 0
    cfg = json.loads((tmp_path / "o" / "train_config.json").read_text())
    assert cfg["block_size"] == 3 and cfg["target_layer_ids"] == [1, 2] and cfg["steps_done"] == 3
    assert cfg["eval_data"] is None and cfg["extra"] == {"data_generation": None}
    assert (tmp_path / "o" / "drafter" / "model.safetensors").is_file()


def test_train_cli_several_heldout_files(target, token_files, tmp_path):
    p = argparse.ArgumentParser()
    add_train_parser(p.add_subparsers(dest="command"))
    base = ["train", "--model", str(target), "--data", str(token_files[0]), "--steps", "2", "--batch-size", "2",
            "--seq-len", "48", "--anchors-per-seq", "4", "--block-size", "3", "--num-layers", "1", "--markov-rank", "4",
            "--target-layer-ids", "1,2", "--mask-token-id", "3", "--device", "cpu", "--eval-seqs", "2"]
    a = p.parse_args(base + ["--out", str(tmp_path / "x"), "--eval-data", f"{token_files[1]},{tmp_path / 'nope.safetensors'}"])
    with pytest.raises(SystemExit, match="nope.safetensors not found"):
        a.func(a)
    a = p.parse_args(base + ["--out", str(tmp_path / "o"), "--eval-data", f"{token_files[1]},{token_files[0]}"])
    assert a.func(a) == 0
    cfg = json.loads((tmp_path / "o" / "train_config.json").read_text())
    assert cfg["eval_data"] == f"{token_files[1]},{token_files[0]}"
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert "heldout_tau_prob" in metrics and "heldout1_tau_prob" in metrics
