"""Dense layers: the parameter-free proxy returns the FFN role's dense MLP output exactly."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dense_mlp(moe_env: Any) -> Any:
    import torch
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

    with torch.device("cpu"):
        mlp = DeepseekV2MLP(
            hidden_size=64, intermediate_size=128, hidden_act="silu", prefix="dense.layers.0.mlp"
        )
    return moe_env.load(mlp, moe_env.checkpoint_for(mlp, seed=7))


def test_remote_dense_mlp_holds_no_parameters() -> None:
    from afd_moe_runners import RemoteDenseMLP

    proxy = RemoteDenseMLP(0)
    assert list(proxy.parameters()) == []
    assert list(proxy.buffers()) == []
    assert "layer_idx=0" in repr(proxy)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_remote_dense_mlp_equals_native_dense_mlp(
    moe_env: Any, dense_mlp: Any, num_tokens: int
) -> None:
    import torch

    from afd_moe_runners import FFNLayerCompute, RemoteDenseMLP

    compute = FFNLayerCompute({0: dense_mlp}, vllm_config=moe_env.vllm_config)
    assert compute.runners == {0: None}
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        expected = dense_mlp(x.clone())
    actual = moe_env.split_forward(RemoteDenseMLP(0), compute, x)
    assert torch.equal(actual, expected)


def test_ffn_entry_rejects_routing_for_a_dense_layer(moe_env: Any, dense_mlp: Any) -> None:
    import torch

    from afd_core.errors import AFDTransferMismatchError
    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners import FFNLayerCompute

    compute = FFNLayerCompute({0: dense_mlp}, vllm_config=moe_env.vllm_config)
    payload = AttentionToFFN(
        torch.zeros(2, 64),
        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
        topk_weights=torch.ones(2, 2),
    )
    with pytest.raises(AFDTransferMismatchError, match="roles disagree on which layers are MoE"):
        compute.compute(0, payload)


def test_ffn_entry_rejects_a_layer_it_does_not_serve(moe_env: Any, dense_mlp: Any) -> None:
    import torch

    from afd_core.errors import AFDTransferMismatchError
    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners import FFNLayerCompute

    compute = FFNLayerCompute({0: dense_mlp}, vllm_config=moe_env.vllm_config)
    with pytest.raises(AFDTransferMismatchError, match=r"serves layers \[0\]"):
        compute.compute(5, AttentionToFFN(torch.zeros(2, 64)))
