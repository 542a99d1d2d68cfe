"""Per-step AFD metadata in vLLM's ForwardContext.additional_kwargs."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDMetadataMissingError
from afd_core.forward_context import (
    AFD_CONTEXT_KEY,
    AFDStepMetadata,
    find_step_metadata,
    get_step_metadata,
    set_step_metadata,
)
from afd_core.testing.null import NullConnector as _Null


class NullConnector(_Null):
    initialized = True


def _vllm_forward_context() -> Any:
    """vLLM's forward_context module. Skipped only where vLLM is absent by design
    (core-no-torch); with vLLM installed a failing import fails the test."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    import vllm.forward_context as fc

    return fc


def _meta(**kwargs: Any) -> AFDStepMetadata:
    return AFDStepMetadata(NullConnector(AFDConfig(role=AFDRole.ATTENTION), rank=0), **kwargs)


def test_set_then_get_on_an_object_with_additional_kwargs() -> None:
    ctx = SimpleNamespace(additional_kwargs={})
    meta = _meta(micro_batch_idx=1, num_micro_batches=2, num_tokens=7)
    set_step_metadata(ctx, meta)
    assert ctx.additional_kwargs[AFD_CONTEXT_KEY] is meta
    assert get_step_metadata(ctx) is meta
    assert find_step_metadata(ctx) is meta


def test_missing_key_says_what_is_missing_and_how_to_fix() -> None:
    ctx = SimpleNamespace(additional_kwargs={"other": 1})
    assert find_step_metadata(ctx) is None
    with pytest.raises(AFDMetadataMissingError) as info:
        get_step_metadata(ctx)
    message = str(info.value)
    assert "additional_kwargs['afd']" in message
    assert "is the afd plugin loaded and additional_config['afd'] set?" in message


def test_wrong_object_under_the_key_is_reported() -> None:
    ctx = SimpleNamespace(additional_kwargs={AFD_CONTEXT_KEY: {"micro_batch_idx": 0}})
    with pytest.raises(AFDMetadataMissingError, match="holds a dict, expected AFDStepMetadata"):
        get_step_metadata(ctx)


def test_object_without_additional_kwargs_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="expected a vLLM ForwardContext"):
        set_step_metadata(object(), _meta())


def test_metadata_validates_its_fields() -> None:
    with pytest.raises(ValueError, match=r"micro_batch_idx: expected 0\.\.1"):
        _meta(micro_batch_idx=2, num_micro_batches=2)
    with pytest.raises(TypeError, match="expected an AFDConnector"):
        AFDStepMetadata(connector=object())  # type: ignore[arg-type]


@pytest.mark.vllm
def test_real_vllm_forward_context_round_trip() -> None:
    fc = _vllm_forward_context()
    ctx = fc.ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    meta = _meta()
    set_step_metadata(ctx, meta)
    assert ctx.additional_kwargs[AFD_CONTEXT_KEY] is meta
    with fc.override_forward_context(ctx):
        assert get_step_metadata() is meta  # read from vLLM's current context


@pytest.mark.vllm
def test_no_current_vllm_forward_context_is_reported() -> None:
    fc = _vllm_forward_context()
    with fc.override_forward_context(None), pytest.raises(AFDMetadataMissingError) as info:
        get_step_metadata()
    assert "no vLLM forward context is set" in str(info.value)
    assert "afd plugin loaded" in str(info.value)
    ctx = fc.ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    with fc.override_forward_context(ctx), pytest.raises(AFDMetadataMissingError):
        get_step_metadata()
