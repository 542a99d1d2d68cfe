"""The torchvision-free import seam for vLLM's qwen3_5, without importing vLLM.

The real import through the seam (and its drift checks) is in test_vllm_drift.py.
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from afd_models_qwen import qwen3_5_import as seam


def _hooks() -> list[object]:
    return [f for f in sys.meta_path if type(f).__name__ == "_Qwen3_5ImportHook"]


@pytest.fixture
def clean_import_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hook installed and qwen3_5 not imported, restored afterwards."""
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f not in _hooks()])
    monkeypatch.delitem(sys.modules, seam.QWEN3_5, raising=False)


def test_hook_is_installed_once_where_torchvision_is_missing(
    clean_import_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seam, "torchvision_missing", lambda: True)
    assert seam.install_import_hook() is True
    assert seam.install_import_hook() is True
    assert len(_hooks()) == 1
    assert sys.meta_path[0] is _hooks()[0]


def test_nothing_is_installed_where_torchvision_is_installed(
    clean_import_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seam, "torchvision_missing", lambda: False)
    assert seam.install_import_hook() is False
    assert _hooks() == []
    # A hook installed earlier stands aside too.
    assert seam._Qwen3_5ImportHook().find_spec(seam.QWEN3_5, None) is None


def test_hook_answers_for_qwen3_5_only(
    clean_import_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seam, "torchvision_missing", lambda: True)
    hook = seam._Qwen3_5ImportHook()
    for name in ("vllm.model_executor.models.qwen3_vl", "json", "torchvision"):
        assert hook.find_spec(name, None) is None


def test_placeholder_is_present_only_during_the_block_and_refuses_images(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, seam.PLACEHOLDER_MODULE, raising=False)
    with seam._placeholder_in_sys_modules():
        placeholder = sys.modules[seam.PLACEHOLDER_MODULE]
        assert sorted(n for n in vars(placeholder) if not n.startswith("__")) == sorted(
            seam.PLACEHOLDER_NAMES
        )
    assert seam.PLACEHOLDER_MODULE not in sys.modules
    with pytest.raises(seam.Qwen3_5ImageInputError, match="needs torchvision") as err:
        placeholder.smart_resize(28, 28)
    assert "--language-model-only" in str(err.value)


def test_a_real_image_processor_module_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ModuleType(seam.PLACEHOLDER_MODULE)
    monkeypatch.setitem(sys.modules, seam.PLACEHOLDER_MODULE, real)
    with seam._placeholder_in_sys_modules():
        assert sys.modules[seam.PLACEHOLDER_MODULE] is real
    assert sys.modules[seam.PLACEHOLDER_MODULE] is real
