"""The Attention-side round trip fails loudly instead of returning a wrong tensor."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm


class WrongDtypeFFN:
    """An FFN side that answers in bfloat16 whatever it was sent (a broken peer)."""

    def compute(self, layer_idx: int, payload: Any) -> Any:
        import torch

        from afd_core.transfer import FFNToAttention

        return FFNToAttention(payload.hidden_states.to(torch.bfloat16))


class SeparateSharedFFN:
    """An FFN side that sends the shared-expert output separately."""

    def compute(self, layer_idx: int, payload: Any) -> Any:
        from afd_core.transfer import FFNToAttention

        x = payload.hidden_states
        return FFNToAttention(x, shared_output=x)


def test_an_answer_of_another_dtype_is_a_transfer_mismatch(moe_env: Any) -> None:
    import torch

    from afd_core.errors import AFDTransferMismatchError
    from afd_moe_runners import RemoteDenseMLP

    with pytest.raises(AFDTransferMismatchError, match="dtype float32, received"):
        moe_env.split_forward(RemoteDenseMLP(2), WrongDtypeFFN(), torch.zeros(3, 64))


def test_a_separate_shared_output_is_refused_by_the_dense_proxy(moe_env: Any) -> None:
    import torch

    from afd_core.errors import AFDTransferMismatchError
    from afd_moe_runners import RemoteDenseMLP

    with pytest.raises(AFDTransferMismatchError, match="separate shared-expert output"):
        moe_env.split_forward(RemoteDenseMLP(2), SeparateSharedFFN(), torch.zeros(3, 64))


def test_forward_without_afd_step_metadata_says_what_is_missing(moe_env: Any) -> None:
    import torch

    from afd_core.errors import AFDMetadataMissingError
    from afd_moe_runners import RemoteDenseMLP

    with moe_env.forward_context(3), pytest.raises(AFDMetadataMissingError, match="afd"):
        RemoteDenseMLP(2)(torch.zeros(3, 64))


def test_hash_routed_input_ids_are_rejected_before_sending(moe_env: Any) -> None:
    import torch

    from afd_core.config import AFDConfig, AFDRole
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import build_afd_moe

    runner = build_afd_moe(
        AFDConfig(role=AFDRole.ATTENTION, connector="LoopbackAFDConnector"),
        num_experts=8,
        top_k=2,
        hidden_size=32,
        intermediate_size=16,
        prefix="exchange.layers.9.mlp.experts",
    )
    x = torch.zeros(2, 32)
    with pytest.raises(AFDConfigError, match="input_ids"):
        runner(x, x, input_ids=torch.zeros(2, dtype=torch.int64))


def test_padding_rows_beyond_the_step_token_count_are_not_sent(moe_env: Any) -> None:
    import torch

    from afd_moe_runners import FFNLayerCompute, RemoteDenseMLP

    class RecordingIdentity(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(x.shape[0])
            return x * 2

    ffn_block = RecordingIdentity()
    compute = FFNLayerCompute({4: ffn_block}, vllm_config=moe_env.vllm_config)
    x = torch.arange(5 * 64, dtype=torch.float32).reshape(5, 64)
    out = moe_env.split_forward(RemoteDenseMLP(4), compute, x, num_tokens=3)
    assert ffn_block.seen == [3]
    assert out.shape == (5, 64)
    assert torch.equal(out[:3], x[:3] * 2)
    assert torch.equal(out[3:], torch.zeros(2, 64))
