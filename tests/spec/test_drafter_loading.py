"""Loading DeepSpec-format drafters (Qwen3 with q/k norms, Llama without) and every configuration
error, each before any work."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark import LLM, SamplingParams
from dspark.spec.config import SpeculativeConfig, SpeculativeConfigError
from tests.conftest import write_tiny_checkpoint
from tests.spec.drafters import random_drafter


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dl")
    return {a: write_tiny_checkpoint(root / a, a, num_hidden_layers=4) for a in ("llama", "qwen3")}


def test_qwen3_deepspec_drafter_loads_with_qk_norms(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["qwen3"], target_layer_ids=[0, 1, 2], block_size=7)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["target_layer_ids"] == [0, 1, 2]
    sd = load_file(str(d / "model.safetensors"))
    assert "layers.0.self_attn.q_norm.weight" in sd and "markov_head.markov_w2.weight" in sd
    # A distinct q_norm must be loaded (not left at ones).
    sd["layers.0.self_attn.q_norm.weight"] = torch.full_like(sd["layers.0.self_attn.q_norm.weight"], 0.5)
    save_file(sd, str(d / "model.safetensors"))
    # (every step verifies: confidence scheduling's pauses would follow measured times)
    llm = LLM(str(targets["qwen3"]), device="cpu", speculative_config={"model": str(d), "confidence_scheduling": False})
    drafter = llm.engine.runner.proposer.drafter
    assert drafter.layers[0].q_norm is not None
    assert torch.all(drafter.layers[0].q_norm.weight == 0.5)
    assert llm.engine.runner.num_spec_tokens == 7  # default: the block size
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.stats["spec_num_steps"] > 0


def test_llama_drafter_has_no_qk_norm_and_shares_embeddings(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2])
    llm = LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d)})
    drafter = llm.engine.runner.proposer.drafter
    model = llm.engine.runner.model
    assert drafter.layers[0].q_norm is None
    assert drafter.embed_tokens is model.embed_tokens  # shared by reference, not copied
    assert not any(p is model.embed_tokens.weight for p in drafter.parameters())


def test_embedding_copies_are_checked_then_dropped(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2])
    tsd = load_file(str(targets["llama"] / "model.safetensors"))
    sd = load_file(str(d / "model.safetensors"))
    sd["embed_tokens.weight"] = tsd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = tsd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"))
    llm = LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d)})
    assert any("equals the target's: dropped" in n for n in llm.engine.spec_notes)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(SpeculativeConfigError, match="lm_head.weight differs from the target's"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d)})


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle"}, "unknown speculative method 'eagle'"),
        ({"model": "x", "num_tokens": 3}, "unknown speculative config key.*num_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"draft_sample_method": "beam"}, "draft_sample_method must be one of"),
        ({"rejection_sample_method": "tree"}, "rejection_sample_method must be one of"),
        ("{not json", "not valid JSON"),
    ],
)
def test_config_errors(spec, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.parse(spec)


def edit(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_size=32), "drafter hidden_size 32 != target hidden_size 64"),
        (dict(vocab_size=300), "drafter vocab_size 300 != target vocab_size 512"),
        (dict(rope_theta=5.0), "drafter rope_theta 5.0 != target rope_theta"),
        (dict(target_layer_ids=[0, 9]), "target_layer_ids: 9 is out of range for 4 layers"),
        (dict(target_layer_ids=[0, 3]), "target_layer_ids: 3 is the target's last layer"),
        (dict(num_target_layers=8), "built for 8 target layers, the target has 4"),
        (dict(architectures=["FooModel"]), "not supported"),
    ],
)
def test_drafter_incompatible_with_target(targets, tmp_path, changes, message):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2])
    edit(d, **changes)
    with pytest.raises(SpeculativeConfigError, match=message):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d)})


def test_too_many_speculative_tokens_names_the_block_size(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2], block_size=5)
    with pytest.raises(SpeculativeConfigError, match="larger than the drafter's block size 5"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d), "num_speculative_tokens": 6})


def test_verify_lengths_past_the_drafts_name_them(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2], block_size=5)
    with pytest.raises(SpeculativeConfigError, match=r"verify_lengths \[2, 6\] go past the 5 drafts a step makes"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d), "verify_lengths": [2, 6]})


def test_missing_drafter_tensor(targets, tmp_path):
    d = random_drafter(tmp_path / "d", targets["llama"], target_layer_ids=[1, 2])
    sd = load_file(str(d / "model.safetensors"))
    del sd["layers.1.mlp.down_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(SpeculativeConfigError, match="missing tensor 'layers.1.mlp.down_proj.weight'"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": str(d)})


def test_missing_drafter_dir(targets):
    with pytest.raises(SpeculativeConfigError, match="no config.json"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={"model": "/nonexistent/drafter"})
    with pytest.raises(SpeculativeConfigError, match="no 'model'"):
        LLM(str(targets["llama"]), device="cpu", speculative_config={})
