"""A GGUF model file converted once into a transformers folder, which later loads read instead.

transformers reads a GGUF file three times per load (tokenizer, config, weights), parsing its whole vocabulary
each time, and de-quantizes every tensor in Python: 20-60 s on a 2-core machine for the models kvshrink is
measured on. The converted folder holds what that load produced: the weights in float32 safetensors (the
de-quantized values exactly; a 16-bit load casts them as the GGUF load does), the config, the generation
config and the tokenizer. It loads in seconds.

One folder per GGUF file content (its SHA-256) and transformers version, under ``$KVSHRINK_MODEL_CACHE``
(default: ``converted`` in `kvshrink.user_cache.cache_home`); it takes about 4 bytes per parameter.
``KVSHRINK_MODEL_CACHE=off`` reads the GGUF file every time. A folder is written under a temporary name and
renamed into place when whole, with a manifest of each file's SHA-256 that every load checks: a reader uses a
whole, verified folder or converts the GGUF file again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from safetensors.torch import save_model

from kvshrink.user_cache import cache_home

MANIFEST = "kvshrink-conversion.json"
FORMAT = 1
OFF = "off"
ABANDONED_S = 3600   # a writer takes seconds to a few minutes
_CHUNK = 1 << 20


def conversion_root() -> Path | None:
    """The folder converted models live in, or None when ``KVSHRINK_MODEL_CACHE=off``."""
    configured = os.environ.get("KVSHRINK_MODEL_CACHE", "")
    if configured == OFF:
        return None
    if configured:
        return Path(configured).expanduser()
    return cache_home() / "converted"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def conversion_key(gguf_sha256: str) -> str:
    """The folder name for a GGUF file's content: transformers' conversion may change between its versions."""
    import transformers

    return f"{gguf_sha256[:32]}-transformers-{transformers.__version__}"


def verified(folder: Path, gguf_sha256: str) -> bool:
    """Whether ``folder`` is a whole conversion of the GGUF file with that SHA-256: its manifest names that
    file and this format, and every file it lists has the SHA-256 it records."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("gguf_sha256") != gguf_sha256 or not files:
            return False
        return all(file_sha256(folder / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def plain_config(config):
    """A copy of ``config`` without the GGUF ``quantization_config`` a GGUF load adds: the folder's weights are
    plain tensors, and a load that saw it would look for the GGUF file."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def remove_abandoned(root: Path) -> None:
    """Remove the temporary folders of writers that stopped (killed, out of space) over `ABANDONED_S` ago."""
    cutoff = time.time() - ABANDONED_S
    for folder in root.glob(".*"):
        try:
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def write_conversion(root: Path, key: str, gguf_sha256: str, model, tokenizer) -> Path | None:
    """Save ``model`` (float32) and ``tokenizer`` as ``root/key``, whole or not at all; the folder, or None
    when it could not be written (no space, a read-only place: the caller has its model either way)."""
    needed = 2 * sum(p.numel() * 4 for p in model.parameters())
    try:
        root.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(root).free < needed:
            warnings.warn(f"kvshrink: not caching the converted GGUF model in {root}: under {needed >> 20} MB free",
                          stacklevel=3)
            return None
        remove_abandoned(root)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    except OSError:
        return None
    try:
        # save_pretrained refuses a model loaded from GGUF (transformers marks it quantized); its weights are
        # plain tensors, and save_model writes a tied pair (embeddings, output head) once
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        plain_config(model.config).save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {"format": FORMAT, "gguf_sha256": gguf_sha256, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        final = root / key
        if final.exists() and not verified(final, gguf_sha256):   # damaged: moved aside whole, then removed
            damaged = Path(tempfile.mkdtemp(prefix=f".{key}.damaged.", dir=root))
            os.rename(final, damaged / key)
            shutil.rmtree(damaged, ignore_errors=True)
        try:
            os.rename(staging, final)
        except OSError:   # another process renamed its own whole copy into place first: readers use that one
            if not verified(final, gguf_sha256):
                raise
        return final
    except Exception as err:   # a cache: whatever stops the write, the caller has its model
        warnings.warn(f"kvshrink: not caching the converted GGUF model in {root}: {err}", stacklevel=3)
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
