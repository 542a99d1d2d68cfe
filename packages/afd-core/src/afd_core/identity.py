"""What a role loaded, as named fields the two roles compare before the first layer.

An Attention role and an FFN role that loaded different checkpoints (another
architecture, other expert weights, another dtype or routing) can still exchange
tensors of the right shapes and serve fluent nonsense. So every rank describes what it
serves as a *deployment fingerprint*: a flat mapping of the names in
:data:`FINGERPRINT_FIELDS` to printable values, compared in the connector handshake
(:mod:`afd_core.admission`) with the host's (attention rank 0). A difference in any
field refuses the joining rank and stops the host, with one message naming each field
and both values (:func:`describe_differences`).

The model-independent fields come from :func:`afd_core.admission.config_fields`; the
model package fills the rest from the loaded model. :func:`checkpoint_identity` is the
content identity of a checkpoint directory, cheap enough to compute at every start (see
its docstring for what it covers and what it does not). This module imports nothing of
afd.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "FINGERPRINT_FIELDS",
    "PROTOCOL_VERSION",
    "checkpoint_identity",
    "describe_differences",
    "differences",
    "format_layers",
]

PROTOCOL_VERSION = "1"
"""Version of the AFD exchange protocol (frames, payload kinds, handshake)."""

FINGERPRINT_FIELDS: tuple[str, ...] = (
    "protocol",
    "connector",
    "topology",
    "attention_tp",
    "expert_shard",
    "architecture",
    "model_type",
    "dtype",
    "quantization",
    "hidden_size",
    "num_layers",
    "moe_layers",
    "num_experts",
    "top_k",
    "scoring_func",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "gate_on_attention",
    "routing_payload",
    "transfer_dtype",
    "transfer_dtype_return",
    "shared_experts",
    "checkpoint",
)
"""Every field a fingerprint may carry, in the order differences are reported."""

# Bytes read from each weight file for the content identity: this many chunks of this
# size at evenly spaced offsets of the data (the header is read whole).
_SAMPLES = 16
_SAMPLE_BYTES = 4096
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WHOLE_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def format_layers(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (``"none"`` when empty)."""
    ordered = sorted(set(indices))
    if not ordered:
        return "none"
    runs: list[str] = []
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


def differences(
    host: Mapping[str, str], joining: Mapping[str, str], *, allow: Iterable[str] = ()
) -> list[tuple[str, str, str]]:
    """``[(field, host value, joining value)]`` for every field that differs.

    A field one side does not carry counts as ``"(absent)"``. Fields in ``allow`` (or all
    of them with ``"*"``) may differ: the operator said so (``afd.fingerprint_allow``).
    """
    allowed = set(allow)
    if "*" in allowed:
        return []
    names = [f for f in FINGERPRINT_FIELDS if f in host or f in joining]
    names += sorted((set(host) | set(joining)) - set(FINGERPRINT_FIELDS))
    out = []
    for name in names:
        a = host.get(name, "(absent)")
        b = joining.get(name, "(absent)")
        if a != b and name not in allowed:
            out.append((name, a, b))
    return out


def describe_differences(diffs: Iterable[tuple[str, str, str]], *, host: str, joining: str) -> str:
    """One line: ``dtype: attention rank 0 has 'bfloat16', ffn rank 0 has 'float32'; ...``."""
    return "; ".join(f"{name}: {host} has {a!r}, {joining} has {b!r}" for name, a, b in diffs)


def _sample(handle: BinaryIO, start: int, end: int) -> Iterable[bytes]:
    length = end - start
    if length <= _SAMPLES * _SAMPLE_BYTES:
        handle.seek(start)
        yield handle.read(length)
        return
    step = (length - _SAMPLE_BYTES) // (_SAMPLES - 1)
    for i in range(_SAMPLES):
        handle.seek(start + i * step)
        yield handle.read(_SAMPLE_BYTES)


def _hash_weight_file(digest: Any, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as handle:
        data_start = 0
        if path.suffix == ".safetensors" and size >= 8:
            header_len = int.from_bytes(handle.read(8), "little")
            if 0 < header_len <= min(_SAFETENSORS_MAX_HEADER, size - 8):
                # Tensor names, dtypes, shapes and offsets.
                digest.update(handle.read(header_len))
                data_start = 8 + header_len
        for chunk in _sample(handle, data_start, size):
            digest.update(chunk)


def checkpoint_identity(model: str | os.PathLike[str]) -> str:
    """Content identity of a checkpoint: 16 hex digits, equal for equal checkpoints.

    For a local directory it hashes ``config.json`` and the weight index files whole,
    and for every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
    ``*.gguf``, sorted by name) its name, its size, its safetensors header (every
    tensor's name, dtype, shape and offsets) and 16 samples of 4 KiB at evenly spaced
    offsets of its data: about 64 KiB per file, whatever the checkpoint's size. Other
    weights, a retrained checkpoint with the same shapes included, change the samples;
    an edit confined to bytes between two samples is not seen. Tokenizer files are not
    covered. The path itself is not part of it: a copy elsewhere has the same identity.

    Anything that is not a directory (a hub model id) is identified by its name:
    ``"name:<model>"``.
    """
    root = Path(model)
    if not root.is_dir():
        return f"name:{model}"
    digest = hashlib.sha256()
    for name in _WHOLE_FILES:
        path = root / name
        if path.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(path.read_bytes())
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    for path in weights:
        _hash_weight_file(digest, path)
    digest.update(json.dumps(len(weights)).encode())
    return digest.hexdigest()[:16]
