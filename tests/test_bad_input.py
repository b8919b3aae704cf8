"""Bad input raises a clear error naming the problem, before any work, and disturbs nothing else."""

from __future__ import annotations

import json

import pytest

from dspark import LLM, InvalidRequestError, SamplingParams
from dspark.models.errors import ModelLoadError
from tests.conftest import write_tiny_checkpoint


def test_unknown_model_name():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        LLM("no-such-model", device="cpu")


def test_checkpoint_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        LLM(str(tmp_path), device="cpu")


def test_corrupt_safetensors(tmp_path):
    write_tiny_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    write_tiny_checkpoint(tmp_path, "llama")
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(tmp_path):
    write_tiny_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        LLM(str(tmp_path), device="cpu")


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"1234")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        LLM(str(f), device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(max_tokens="5"), "max_tokens must be an integer"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_unknown_sampling_fields():
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter.*foo"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    with pytest.raises(TypeError, match="foo"):
        SamplingParams(foo=1)


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), device="cpu", block_size=4, num_kv_blocks=256, max_model_len=64)


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(InvalidRequestError, match="prompt has 65 tokens, more than max_model_len 64"):
        tiny_llm.generate([[5] * 65])


def test_bad_prompts(tiny_llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        tiny_llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="token id 9999 is out of range"):
        tiny_llm.generate([[3, 9999]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        tiny_llm.generate(["text needs a tokenizer"])


def test_bad_request_does_not_disturb_running_ones(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11], [20, 21, 22]]
    want = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request([1] * 100, params)
    with pytest.raises(InvalidRequestError):
        engine.add_request(prompts[0], params, request_id=ids[0])  # duplicate id
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[i] for i in ids] == want
    assert engine.kv.check_integrity()["in_use"] == 0


def test_batch_with_an_invalid_prompt_leaves_engine_clean(tiny_llm):
    with pytest.raises(InvalidRequestError, match="out of range"):
        tiny_llm.generate([[3, 4], [5, 6], [7, 100000]])
    assert not tiny_llm.engine.requests and not tiny_llm.engine.has_unfinished()
    assert tiny_llm.engine.kv.check_integrity()["in_use"] == 0
    assert len(tiny_llm.generate([[3, 4]], SamplingParams(max_tokens=3))[0].token_ids) >= 1


def test_max_model_len_beyond_model(tiny_checkpoints):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 1024"):
        LLM(str(tiny_checkpoints["llama"]), device="cpu", max_model_len=4096)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(device="cpu", dtype="float8")
