"""Routed experts of the Attention role: they exist for vLLM's bookkeeping, hold no weights.

On the Attention role the expert weights belong to the FFN role. The FusedMoE
factory still builds a ``RoutedExperts`` (the runner, the expert maps and the
weight-name mapping expect one), so :class:`RemoteRoutedExperts` keeps that object
and swaps its quantization method for :class:`RemoteExpertsMethod`, whose
``create_weights`` registers nothing and whose kernels refuse to run. Swapping the
method (rather than subclassing ``UnquantizedFusedMoEMethod``) also covers quantized
checkpoints: whatever ``quant_config`` the model passes, no fp8/int4 tensors or scales
are allocated on the Attention role.

The Attention-side layer checks (:func:`check_attention_moe_layer`) run here, at the
first AFD code the factory calls, so an unsupported configuration fails while the
model is being built, before vLLM's own EPLB checks report something less helpful.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from afd_core.errors import AFDConfigError
from afd_moe_runners._vllm_compat import check_vllm_version

check_vllm_version()

__all__ = [
    "RemoteExpertsMethod",
    "RemoteRoutedExperts",
    "check_attention_moe_layer",
    "require_remote_experts",
]


def check_attention_moe_layer(
    layer_name: str,
    moe_config: FusedMoEConfig,
    *,
    routed_scaling_factor: float,
    router: FusedMoERouter | None = None,
) -> None:
    """Reject MoE features the Attention role cannot honour when its experts are remote."""
    where = f"AFD Attention-role MoE layer {layer_name!r}"
    parallel = moe_config.moe_parallel_config
    # The factory's enable_eplb= shows up as the router's EPLB state; the engine-wide
    # --enable-eplb as the parallel config flag. Either is an Attention-side EPLB.
    if parallel.enable_eplb or (router is not None and router.eplb_state is not None):
        raise AFDConfigError(
            f"{where}: EPLB is enabled on the Attention role, which holds no experts to "
            "rebalance; disable it there (enable_eplb=False / no --enable-eplb for the "
            "Attention engine) and configure EPLB on the FFN role instead"
        )
    redundant = moe_config.num_experts - moe_config.num_logical_experts
    if redundant:
        raise AFDConfigError(
            f"{where}: {redundant} redundant experts requested "
            f"(eplb_config.num_redundant_experts={redundant}) on the Attention role; set "
            "num_redundant_experts=0 for the Attention engine (redundant experts belong "
            "to the FFN role)"
        )
    if parallel.is_sequence_parallel:
        raise AFDConfigError(
            f"{where}: sequence-parallel MoE (use_sequence_parallel_moe) is not supported "
            "by the AFD runners; disable it for the Attention engine"
        )
    if moe_config.skip_final_all_reduce and moe_config.tp_size > 1:
        raise AFDConfigError(
            f"{where}: the model builds this MoE with reduce_results=False (all-reduce fused "
            "downstream) under tensor parallelism, but the FFN role returns an already "
            "reduced output that must not be summed again; build it with reduce_results=True"
        )
    if get_current_vllm_config().aux_output_config.enabled:
        raise AFDConfigError(
            f"{where}: routed-expert capture (enable_return_routed_experts / "
            "aux_output_config) is enabled, but with AFD expert selection is not "
            "reported back from the FFN role; turn it off for the Attention engine"
        )
    if not math.isfinite(routed_scaling_factor):
        raise AFDConfigError(
            f"{where}: routed_scaling_factor={routed_scaling_factor!r} is not a finite "
            "number; fix routed_scaling_factor in the model config (hf_overrides)"
        )


class RemoteExpertsMethod(FusedMoEMethodBase):
    """Expert "quantization" method of the Attention role: no weights, no kernel."""

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        # Deliberately registers nothing: the FFN role owns these weights.
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig | None:
        return None

    def _refuse(self, layer: RoutedExperts) -> torch.Tensor:
        raise RuntimeError(
            f"{layer.layer_name}: the Attention role's routed experts are remote (AFD) and "
            "hold no weights; this layer must run through an AFD MoE runner "
            "(afd_moe_runners.afd_runner_kwargs), not vLLM's default MoERunner"
        )

    def apply(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._refuse(layer)

    def apply_monolithic(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self._refuse(layer)


class RemoteRoutedExperts(RoutedExperts):
    """``routed_experts_cls`` of the Attention role: same bookkeeping, zero parameters."""

    def __init__(
        self,
        layer_name: str,
        params_dtype: torch.dtype,
        moe_config: FusedMoEConfig,
        quant_config: QuantizationConfig | None,
        *args: Any,
        routed_scaling_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        check_attention_moe_layer(
            layer_name, moe_config, routed_scaling_factor=routed_scaling_factor
        )
        # RoutedExperts keeps the gate's correction bias (registering it as one of its
        # own parameters) only for kernels that route internally; none runs here, and
        # the router keeps its own reference. Dropping it keeps this module empty.
        kwargs["e_score_correction_bias"] = None
        super().__init__(
            layer_name,
            params_dtype,
            moe_config,
            quant_config,
            *args,
            routed_scaling_factor=routed_scaling_factor,
            **kwargs,
        )

    # Private vLLM 0.32 hook (see _vllm_compat): the only point that runs before
    # create_weights regardless of quant_config.
    def _get_quant_method(
        self,
        prefix: str,
        quant_config: QuantizationConfig | None,
        moe_config: FusedMoEConfig,
    ) -> FusedMoEMethodBase:
        return RemoteExpertsMethod(moe_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        for name, _ in weights:
            raise AFDConfigError(
                f"{self.layer_name}: expert tensor {name!r} was routed to the Attention "
                "role, whose experts are remote; drop expert tensors in the Attention "
                "wrapper's load_weights (they belong to the FFN role)"
            )
        return iter(())


def require_remote_experts(where: str, routed_experts: object) -> None:
    """An Attention-role runner must be built with parameter-free routed experts."""
    if not isinstance(routed_experts, RemoteRoutedExperts):
        raise AFDConfigError(
            f"{where}: needs parameter-free experts; pass routed_experts_cls="
            f"RemoteRoutedExperts to the factory (got {type(routed_experts).__name__}); "
            "afd_runner_kwargs() returns both"
        )
