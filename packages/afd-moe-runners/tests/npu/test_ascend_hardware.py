"""vLLM-Ascend classes: drift checks and class shapes on an Ascend host.

``@pytest.mark.npu`` tests skip with a reason where ``vllm_ascend`` / ``torch_npu``
are missing (never on this project's CI machines). The version guard runs anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

from afd_moe_runners.npu._ascend_compat import (
    VLLM_ASCEND_ATTRIBUTES,
    VLLM_ASCEND_MEMBERS,
    check_vllm_ascend_version,
)

_MISSING = [m for m in ("torch_npu", "vllm_ascend") if importlib.util.find_spec(m) is None]
requires_ascend = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"requires an Ascend host with {' and '.join(_MISSING) or 'nothing'} "
    "(vllm-ascend==0.32.*, torch_npu)",
)


def _resolve(path: str) -> object:
    module_name, _, qualname = path.partition(":")
    target: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0rc1", "0.32.1+ascend"])
def test_vllm_ascend_guard_accepts_the_032_line(version: str) -> None:
    check_vllm_ascend_version(version)


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0rc1", "unknown"])
def test_vllm_ascend_guard_names_the_fix(version: str) -> None:
    with pytest.raises(ImportError, match=r"install vllm-ascend==0\.32\.\*"):
        check_vllm_ascend_version(version)


@pytest.mark.npu
@requires_ascend
def test_installed_vllm_ascend_is_the_supported_line() -> None:
    from afd_moe_runners.npu._ascend_compat import require_vllm_ascend

    require_vllm_ascend("this test")


@pytest.mark.npu
@requires_ascend
@pytest.mark.parametrize("path", sorted(VLLM_ASCEND_MEMBERS))
def test_vllm_ascend_members_keep_their_signature(path: str) -> None:
    params = tuple(inspect.signature(_resolve(path)).parameters)  # type: ignore[arg-type]
    assert params == VLLM_ASCEND_MEMBERS[path], (
        f"{path} changed upstream; re-check afd_moe_runners.npu (see _ascend_compat)"
    )


@pytest.mark.npu
@requires_ascend
@pytest.mark.parametrize("path", VLLM_ASCEND_ATTRIBUTES)
def test_vllm_ascend_names_exist(path: str) -> None:
    _resolve(path)


@pytest.mark.npu
@requires_ascend
def test_afd_comm_classes_override_only_the_prepare_finalize_selector() -> None:
    from vllm_ascend.ops.fused_moe.moe_comm_method import AllGatherCommImpl, MC2CommImpl
    from vllm_ascend.ops.fused_moe.prepare_finalize import (
        PrepareAndFinalizeWithAllGather,
        PrepareAndFinalizeWithMC2,
    )

    from afd_moe_runners.npu import ascend

    for comm, upstream in (
        (ascend.AFDAllGatherCommImpl, AllGatherCommImpl),
        (ascend.AFDMC2CommImpl, MC2CommImpl),
    ):
        assert comm.__bases__ == (upstream,)
        own = {k for k, v in vars(comm).items() if callable(v)}
        assert own == {"_get_prepare_finalize"}
    assert issubclass(ascend.AFDPrepareAndFinalizeWithAllGather, PrepareAndFinalizeWithAllGather)
    assert issubclass(ascend.AFDPrepareAndFinalizeWithMC2, PrepareAndFinalizeWithMC2)
    # No global patch: the upstream classes keep their own prepare.
    assert "prepare_external" not in vars(PrepareAndFinalizeWithMC2)
    assert "prepare_external" not in vars(PrepareAndFinalizeWithAllGather)


@pytest.mark.npu
@requires_ascend
def test_npu_runner_classes_derive_from_ascend_moe_runner() -> None:
    from vllm_ascend.ops.fused_moe.fused_moe import AscendMoERunner

    from afd_moe_runners.external_routing_runner import ExternalRoutingForward
    from afd_moe_runners.npu.runners import npu_runner_classes
    from afd_moe_runners.remote_runner import RemoteExpertsForward

    classes = npu_runner_classes()
    assert classes.remote_experts_runner.__bases__ == (RemoteExpertsForward, AscendMoERunner)
    assert classes.attention_gate_runner.__bases__ == (ExternalRoutingForward, AscendMoERunner)
    assert hasattr(classes.routed_experts, "quant_type")
