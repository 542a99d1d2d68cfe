"""The multi-token-prediction (MTP) layers of a tiny checkpoint, as DeepSeek-V3 ships them.

transformers builds no MTP layers, so the generator (:mod:`afd.tools.models.tiny`) writes
them itself for a config with ``num_nextn_predict_layers`` = n > 0 (DeepSeek-V3's ``mtp``
variant), to :data:`MTP_FILE` beside ``model.safetensors``: layer ``num_hidden_layers + i``
is a full decoder layer of the model's own class (MLA attention and an MoE block, named
per expert like the main file) plus ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head`` (its norm, and a copy of ``lm_head`` as its head), drawn with the
generator's init from seeds after the main model's, so the main model's tensors are those
of the same checkpoint without MTP. vLLM reads them for ``--speculative-config
'{"method": "deepseek_mtp", ...}'`` (vllm/model_executor/models/deepseek_mtp.py) and skips
them otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from afd_moe_runners.recipes import TinyRecipe

__all__ = ["MTP_FILE", "save_mtp_layers"]

#: The file of a checkpoint's multi-token-prediction layers (see the module docstring).
MTP_FILE = "mtp.safetensors"


def save_mtp_layers(
    model: Any,
    config: Any,
    path: Path,
    seed: int,
    spec: TinyRecipe,
    init_weights: Callable[[Any, int, tuple[str, ...], tuple[str, ...]], None],
) -> None:
    """Write ``config.num_nextn_predict_layers`` MTP layers as DeepSeek-V3 names them
    (``model.layers.{num_hidden_layers + i}.*``) to ``path``, bf16 but the router
    biases. ``model``: the main model (its ``lm_head`` is the shared head's copy);
    ``init_weights``: the generator's seeded init.

    The decoder layers come from the same model class with the extra layers, initialised
    and saved by transformers (which writes its fused experts per expert, as the main
    file has them); only those layers' tensors are kept."""
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    first = int(config.num_hidden_layers)
    n = int(config.num_nextn_predict_layers)
    hidden = int(config.hidden_size)
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = first + n
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        donor = type(model)(longer)
        extras = torch.nn.ModuleDict()
        for i in range(n):
            extras[str(first + i)] = torch.nn.ModuleDict(
                {
                    "enorm": torch.nn.RMSNorm(hidden),
                    "hnorm": torch.nn.RMSNorm(hidden),
                    "eh_proj": torch.nn.Linear(2 * hidden, hidden, bias=False),
                    "shared_head": torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(hidden)}),
                }
            )
    finally:
        torch.set_default_dtype(prev_dtype)
    init_weights(donor, seed + 1, spec.extra_buffers, spec.transposed)
    init_weights(extras, seed + 1 + n, spec.extra_buffers, spec.transposed)
    # Stored as the main file: bf16, router correction biases fp32.
    named = [*donor.named_buffers(), *donor.named_parameters()]
    keep_fp32 = {
        k: t.detach().clone() for k, t in named if k.rsplit(".", 1)[-1] in spec.extra_buffers
    }
    donor.to(torch.bfloat16)
    for k, t in [*donor.named_buffers(), *donor.named_parameters()]:
        if k in keep_fp32:
            t.data = keep_fp32[k]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        donor.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    prefixes = tuple(f"model.layers.{first + i}." for i in range(n))
    tensors = {k: v.contiguous() for k, v in saved.items() if k.startswith(prefixes)}
    for name, t in extras.named_parameters():
        tensors[f"model.layers.{name}"] = t.detach().to(torch.bfloat16).contiguous()
    head = model.lm_head.weight.detach().to(torch.bfloat16).clone()
    for i in range(n):
        tensors[f"model.layers.{first + i}.shared_head.head.weight"] = head.clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
