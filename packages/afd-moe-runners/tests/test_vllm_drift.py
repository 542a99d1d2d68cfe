"""Drift: the vLLM 0.32 members this package overrides or calls still look the same."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from afd_moe_runners._vllm_compat import PRIVATE_VLLM_SYMBOLS


def _resolve(path: str) -> object:
    module_name, _, qualname = path.partition(":")
    target: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _params(fn: object) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_version_guard_accepts_the_032_line() -> None:
    from afd_moe_runners._vllm_compat import check_vllm_version

    for version in ("0.32.0", "0.32.3+cpu", "0.32.1rc1"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "nightly"])
def test_version_guard_names_the_fix_for_other_versions(version: str) -> None:
    from afd_moe_runners._vllm_compat import check_vllm_version

    with pytest.raises(ImportError, match=f"supports vLLM 0.32.x only, found vLLM {version}"):
        check_vllm_version(version)


@pytest.mark.vllm
def test_installed_vllm_is_the_supported_line() -> None:
    from afd_moe_runners._vllm_compat import check_vllm_version

    check_vllm_version()


@pytest.mark.vllm
@pytest.mark.parametrize("path", sorted(PRIVATE_VLLM_SYMBOLS))
def test_private_vllm_members_keep_their_signature(path: str) -> None:
    assert _params(_resolve(path)) == PRIVATE_VLLM_SYMBOLS[path], (
        f"{path} changed upstream; re-check the AFD code that uses it (see _vllm_compat)"
    )


@pytest.mark.vllm
def test_public_seams_the_runners_rely_on() -> None:
    from vllm.forward_context import ForwardContext
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    factory = set(_params(FusedMoEFactory))
    assert {"runner_cls", "runner_args", "routed_experts_cls", "gate", "shared_experts"} <= factory
    assert _params(MoERunner.forward) == (
        "self",
        "hidden_states",
        "router_logits",
        "input_ids",
        "shared_experts_input",
    )
    assert _params(MoERunner.__init__) == (
        "self",
        "layer_name",
        "moe_config",
        "router",
        "routed_experts",
        "enable_dbo",
        "gate",
        "shared_experts",
        "shared_expert_gate",
        "routed_input_transform",
        "routed_output_transform",
        "routed_scaling_factor",
    )
    assert _params(RoutedExperts.__init__)[:5] == (
        "self",
        "layer_name",
        "params_dtype",
        "moe_config",
        "quant_config",
    )
    assert _params(RoutedExperts.forward_modular)[:4] == ("self", "x", "topk_weights", "topk_ids")
    # 0.32 has no is_internal_router: the runner owns the gate.
    assert not hasattr(MoERunner, "is_internal_router")
    for name in ("maybe_forward_async", "wait", "forward", "output"):
        assert hasattr(SharedExperts, name), name
    assert "additional_kwargs" in ForwardContext.__dataclass_fields__


def test_get_rope_caches_in_the_dict_the_dry_build_restores(vllm_config: Any) -> None:
    """The split plan's dry build (on ``meta``) restores ``_ROPE_DICT`` afterwards; this
    fails when get_rope caches elsewhere (a ``meta`` rotary embedding could then reach
    the real build, which refuses it)."""
    import torch
    from vllm.model_executor.layers import rotary_embedding

    with torch.device("meta"):
        before = dict(rotary_embedding._ROPE_DICT)
        rope = rotary_embedding.get_rope(32, 128)
        assert rotary_embedding.get_rope(32, 128) is rope
        assert rope in rotary_embedding._ROPE_DICT.values()
    rotary_embedding._ROPE_DICT.clear()
    rotary_embedding._ROPE_DICT.update(before)


def test_the_dry_build_leaves_no_meta_layer_in_vllm_caches(vllm_config: Any) -> None:
    import torch
    from vllm.model_executor.layers import rotary_embedding

    from afd_moe_runners.split_plan import _private_layer_caches

    before = dict(rotary_embedding._ROPE_DICT)
    with _private_layer_caches(), torch.device("meta"):
        rotary_embedding.get_rope(32, 96)
    assert before == rotary_embedding._ROPE_DICT
