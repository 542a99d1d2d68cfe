"""The vLLM-Ascend release line the NPU runners target, and the members they rely on.

Nothing here imports ``vllm_ascend`` at module level. The NPU classes subclass
vLLM-Ascend classes (no upstream class or function is patched); the members below
are what they subclass, override or call. ``tests/npu/test_ascend_hardware.py``
asserts these signatures on an Ascend host (``@pytest.mark.npu``), so an upgrade
fails there in one obvious place.

Revisions read (vllm-project/vllm-ascend, main line after the ``FusedMoEFactory``
rename, the one that serves vLLM 0.32; the PR that introduced this path pins
vLLM-Ascend ``bd42eea0``, which the reference index does not hold, so these are the
nearest stored copies):

* ``vllm_ascend/ops/fused_moe/fused_moe.py`` @ ``008c0da3279f``: ``AscendMoERunner``
  (constructor as vLLM's ``MoERunner``; reads ``routed_experts.quant_type``; wraps
  ``shared_experts`` in ``AscendSharedExperts``; defines ``is_internal_router``);
* ``vllm_ascend/ops/fused_moe/moe_comm_method.py`` @ ``0011ce33514b``:
  ``MoECommMethod.__init__(moe_config)`` calls ``self._get_prepare_finalize()`` and
  keeps it as ``self.prepare_finalize``; ``finalize(hidden_states, reduce_results,
  padded_hidden_states_shape)``; ``AllGatherCommImpl`` / ``MC2CommImpl`` /
  ``AlltoAllCommImpl`` / ``FusedMC2CommImpl``;
* ``vllm_ascend/ops/fused_moe/prepare_finalize.py`` @ ``057a52847c74``:
  ``PrepareAndFinalizeWithAllGather`` / ``PrepareAndFinalizeWithMC2``
  ``prepare(hidden_states, router_logits, replace_allreduce, quant_type)`` pad,
  gather and shard ``router_logits`` row for row with ``hidden_states``;
* ``vllm_ascend/ops/fused_moe/routed_experts.py`` @ ``010024d7cbdc``:
  ``AscendUnquantizedFusedMoEMethod.apply(layer, x, topk_weights, topk_ids,
  shared_experts, shared_experts_input)`` reads ``layer.ascend_mc2_mask`` /
  ``layer.ascend_pertoken_scale`` and dispatches through
  ``_EXTRA_CTX.moe_comm_method.fused_experts``;
* ``vllm_ascend/ascend_forward_context.py``: ``_EXTRA_CTX`` (attribute proxy over the
  forward context: ``moe_comm_type``, ``moe_comm_method``), ``MoECommType``.

Drift notes:

* the comm registry's key changed across revisions (``get_moe_comm_method(type)`` vs
  ``(type, (num_experts, num_local_experts))``); the external-routing component never
  uses the registry: it builds its own candidates and falls back from an unset
  ``moe_comm_method`` to ``moe_comm_type``;
* ``MoEPrepareOutput`` moved between modules (``dataclass.prepare_finalize`` /
  ``moe_runtime_args``); it is never imported, only ``dataclasses.replace``-d;
* ``AscendUnquantizedFusedMoEMethod.apply`` returns a ``FusedExpertsResult`` in some
  revisions and a tensor in others; both are accepted.
"""

from __future__ import annotations

SUPPORTED_VLLM_ASCEND = (0, 32)
"""``(major, minor)`` of the vLLM-Ascend release line (it follows vLLM's numbering)."""

VLLM_ASCEND_REVISIONS_READ = {
    "vllm_ascend/ops/fused_moe/fused_moe.py": "008c0da3279f52ab42b5907eea3e2b055f364e93",
    "vllm_ascend/ops/fused_moe/moe_comm_method.py": "0011ce33514bff5e5ab9641d19c84f4cda82ea05",
    "vllm_ascend/ops/fused_moe/prepare_finalize.py": "057a52847c74ba0809c8c2e5972cc44ea3b82dcd",
    "vllm_ascend/ops/fused_moe/routed_experts.py": "010024d7cbdc3724b3aac1c4896402118362f335",
}

_RUNNER_INIT = (
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
_PREPARE = ("self", "hidden_states", "router_logits", "replace_allreduce", "quant_type")
_FINALIZE = ("self", "hidden_states", "reduce_results", "padded_hidden_states_shape")

VLLM_ASCEND_MEMBERS: dict[str, tuple[str, ...]] = {
    "vllm_ascend.ops.fused_moe.fused_moe:AscendMoERunner.__init__": _RUNNER_INIT,
    "vllm_ascend.ops.fused_moe.prepare_finalize:PrepareAndFinalizeWithAllGather.prepare": _PREPARE,
    "vllm_ascend.ops.fused_moe.prepare_finalize:PrepareAndFinalizeWithAllGather.finalize": (
        _FINALIZE
    ),
    "vllm_ascend.ops.fused_moe.prepare_finalize:PrepareAndFinalizeWithMC2.prepare": _PREPARE,
    "vllm_ascend.ops.fused_moe.prepare_finalize:PrepareAndFinalizeWithMC2.finalize": _FINALIZE,
    "vllm_ascend.ops.fused_moe.moe_comm_method:MoECommMethod.__init__": ("self", "moe_config"),
    "vllm_ascend.ops.fused_moe.moe_comm_method:MoECommMethod.finalize": _FINALIZE,
    "vllm_ascend.ops.fused_moe.moe_comm_method:AllGatherCommImpl._get_prepare_finalize": ("self",),
    "vllm_ascend.ops.fused_moe.moe_comm_method:MC2CommImpl._get_prepare_finalize": ("self",),
    "vllm_ascend.ops.fused_moe.routed_experts:AscendUnquantizedFusedMoEMethod.apply": (
        "self",
        "layer",
        "x",
        "topk_weights",
        "topk_ids",
        "shared_experts",
        "shared_experts_input",
    ),
}
"""``"module:Class.member"`` -> parameter names (checked on Ascend hosts)."""

VLLM_ASCEND_ATTRIBUTES = (
    "vllm_ascend.ascend_forward_context:_EXTRA_CTX",
    "vllm_ascend.ascend_forward_context:MoECommType.ALLGATHER",
    "vllm_ascend.ascend_forward_context:MoECommType.MC2",
    "vllm_ascend.ascend_forward_context:MoECommType.ALLTOALL",
    "vllm_ascend.ascend_forward_context:MoECommType.FUSED_MC2",
    "vllm_ascend.ops.fused_moe.moe_comm_method:AlltoAllCommImpl",
    "vllm_ascend.ops.fused_moe.moe_comm_method:FusedMC2CommImpl",
    "vllm_ascend.quantization.quant_type:QuantType.NONE",
)
"""Other vLLM-Ascend names used (existence checked on Ascend hosts)."""

INSTALL_HINT = (
    "install vllm-ascend for vLLM 0.32 (vllm-ascend==0.32.*, with torch_npu) on an Ascend "
    "host, or run the Attention role on platform cpu/cuda"
)


def require_vllm_ascend(what: str) -> None:
    """Import ``vllm_ascend`` and check its release line, or raise ``ImportError`` with the fix."""
    try:
        import vllm_ascend
    except ImportError as exc:
        raise ImportError(
            f"{what} needs vLLM-Ascend, which is not importable ({exc}); {INSTALL_HINT}"
        ) from exc
    check_vllm_ascend_version(vllm_ascend_version(vllm_ascend))


def vllm_ascend_version(module: object | None = None) -> str:
    """The installed vLLM-Ascend version (distribution metadata, else ``__version__``)."""
    from importlib import metadata

    try:
        return metadata.version("vllm-ascend")
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def check_vllm_ascend_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` is on the 0.32 line."""
    from afd_moe_runners._vllm_compat import release_line

    if release_line(version) != SUPPORTED_VLLM_ASCEND:
        wanted = ".".join(str(p) for p in SUPPORTED_VLLM_ASCEND)
        raise ImportError(
            f"afd-moe-runners' NPU runners support vLLM-Ascend {wanted}.x only, found "
            f"{version}: install vllm-ascend=={wanted}.*"
        )
