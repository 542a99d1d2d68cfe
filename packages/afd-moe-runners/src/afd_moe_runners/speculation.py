"""Speculative decoding under AFD: which of vLLM's methods afd serves, and what it refuses.

Torch- and vLLM-free: the roles' start-up checks (:mod:`afd_moe_runners.start_up`), the
FFN server and ``afd launch`` (before any process starts) ask the same functions.

* draft-free proposers (:data:`DRAFT_FREE_METHODS`: vLLM's n-gram prompt lookup) run on
  the Attention role's side of vLLM; a verification step is a forward of the AFD model
  with up to ``1 + k`` tokens per request, which every layer's exchange carries like a
  prefill chunk (the token count travels with each message). Served.
* DeepSeek MTP (:data:`ATTENTION_DRAFTERS`, vLLM's ``mtp``): the MTP layer is a whole
  decoder layer (MLA attention and an MoE block) that vLLM builds as the drafter beside the
  AFD model, natively, from the same checkpoint; afd runs it whole on the Attention role,
  its experts local (docs/architecture.md, "Speculative decoding", says why). Served with
  one attention rank; with several, refused (the drafter's native MoE layer would be
  sharded and dispatched across the attention ranks by vLLM's data-parallel MoE).
* any other drafter with weights (EAGLE, a draft model, ...) is refused in one line
  naming the method.
* micro-batching (``afd.num_micro_batches > 1``) with any speculation: refused (the
  micro-batch plan splits requests; a verification step's draft rows would have to stay
  with their request, which the splitter does not promise yet).

The FFN role has no proposer: its server drops a speculative config given to it (after
the same check), so the FFN role never builds a drafter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ATTENTION_DRAFTERS",
    "DRAFT_FREE_METHODS",
    "SPECULATIVE_OPTIONS",
    "micro_batched_speculation_problem",
    "speculative_method",
    "speculative_problem",
    "speculative_settings",
]

#: vLLM speculative methods afd serves: draft-free proposers on the Attention role.
DRAFT_FREE_METHODS = frozenset({"ngram"})
#: Drafters with weights afd serves, built and run whole (experts included) by vLLM on the
#: Attention role: DeepSeek's MTP layer (vLLM names every ``*_mtp`` method ``mtp``).
ATTENTION_DRAFTERS = frozenset({"mtp"})

#: vLLM's command-line options that ask for speculative decoding (vllm/engine/arg_utils.py).
SPECULATIVE_OPTIONS = (
    "--speculative-config",
    "-sc",
    "--spec-method",
    "--spec-model",
    "--spec-tokens",
)


def speculative_method(config: Mapping[str, Any] | Any | None) -> str | None:
    """The speculative method vLLM 0.32 would run for ``config`` (its ``--speculative-config``
    mapping or a built ``SpeculativeConfig``), None for no speculation.

    Mirrors how vLLM names it (config/speculative.py, ``__post_init__``): an explicit
    ``method``; else ``model`` ``"ngram"`` is n-gram, any other model (or none) a
    draft model; every ``*_mtp`` method is ``"mtp"``.
    """
    if config is None:
        return None
    if isinstance(config, Mapping):
        method, model = config.get("method"), config.get("model")
    else:
        method, model = getattr(config, "method", None), getattr(config, "model", None)
    if method is None:
        return "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    method = str(method)
    if method == "[ngram]":
        return "ngram"
    if method.endswith("_mtp"):
        return "mtp"
    return method


def speculative_problem(
    method: str | None, model_name: str, *, num_attention_ranks: int = 1
) -> str | None:
    """Why afd cannot serve speculative ``method`` (:func:`speculative_method`) with
    ``num_attention_ranks`` attention ranks, or None (no speculation, a draft-free
    method, or MTP on one attention rank)."""
    if method is None or method in DRAFT_FREE_METHODS:
        return None
    if method in ATTENTION_DRAFTERS:
        if num_attention_ranks == 1:
            return None
        return (
            f"{model_name}: speculative decoding method {method!r} with "
            f"{num_attention_ranks} attention ranks is not supported by afd yet (the MTP "
            "layer runs natively on the Attention role, where vLLM would shard its MoE "
            "block across the data-parallel attention ranks); use one attention rank, or "
            "method 'ngram'"
        )
    allowed = ", ".join(repr(m) for m in sorted(DRAFT_FREE_METHODS | ATTENTION_DRAFTERS))
    return (
        f"{model_name}: speculative decoding method {method!r} is not supported by afd (its "
        "drafter is a model of its own whose layers afd does not split); use "
        f"{allowed} or remove the speculative config"
    )


def micro_batched_speculation_problem(num_micro_batches: int) -> str:
    """The refusal of ``afd.num_micro_batches`` > 1 together with speculative decoding."""
    return (
        f"afd.num_micro_batches={num_micro_batches} cannot be combined with speculative "
        "decoding yet; set afd.num_micro_batches=1 or drop the speculative config"
    )


def speculative_settings(args: Sequence[str]) -> dict[str, Any] | None:
    """The speculative config that vLLM command-line ``args`` ask for, as vLLM merges it
    (``--speculative-config`` / ``-sc`` JSON, then ``--spec-method``, ``--spec-model``,
    ``--spec-tokens``), or None when they ask for none.

    Raises ``ValueError`` for a ``--speculative-config`` that is not a JSON object.
    """
    found: dict[str, Any] | None = None
    flags = {
        "--spec-method": "method",
        "--spec-model": "model",
        "--spec-tokens": "num_speculative_tokens",
    }
    items = list(args)
    for i, arg in enumerate(items):
        opt, eq, inline = arg.partition("=")
        if opt not in SPECULATIVE_OPTIONS:
            continue
        value = inline if eq else (items[i + 1] if i + 1 < len(items) else "")
        found = {} if found is None else found
        if opt in ("--speculative-config", "-sc"):
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"{opt}: expected a JSON object, got {value!r}")
            found.update({k.replace("-", "_"): v for k, v in parsed.items()})
        else:
            found[flags[opt]] = value
    return found
