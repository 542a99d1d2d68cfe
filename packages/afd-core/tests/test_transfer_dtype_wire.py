"""Low-precision transfer on the wire (issue 44): what a transport is handed for each
transfer dtype (8-bit elements, scales in the same message), the frame words that
announce it, and the ``model`` path left as it was (the payload's own tensors, no copy)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from afd_core.config import AFDConfig, AFDRole  # noqa: E402
from afd_core.errors import AFDTransferMismatchError  # noqa: E402
from afd_core.testing.loopback import LoopbackAFDConnector, LoopbackTransport  # noqa: E402
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind, make_header  # noqa: E402
from afd_core.wire import FRAME_LEN, Frame  # noqa: E402

HIDDEN = 40
_ports = itertools.count(21000)


def make_pair(**overrides: Any) -> tuple[list[LoopbackAFDConnector], list[LoopbackAFDConnector]]:
    """One attention and one FFN loopback connector, initialised."""
    port = next(_ports)

    def build(role: AFDRole) -> LoopbackAFDConnector:
        config = AFDConfig(
            role=role,
            connector=LoopbackAFDConnector.name,
            host="test-transfer-dtype",
            port=port,
            **overrides,
        )
        conn = LoopbackAFDConnector(config, rank=0)
        conn.init()
        return conn

    return [build(AFDRole.ATTENTION)], [build(AFDRole.FFN)]


class _Recorder:
    """Wraps a transport's ``send`` to keep what it was handed: (frame, tensors)."""

    def __init__(self, transport: LoopbackTransport) -> None:
        self.sent: list[tuple[Frame, list[Any]]] = []
        original = transport.send

        def send(ctx: Any, messages: Any) -> None:
            messages = list(messages)
            self.sent += [(frame, list(tensors)) for _, frame, tensors in messages]
            original(ctx, messages)

        transport.send = send  # type: ignore[method-assign]


def _round(name: str, back: str) -> tuple[_Recorder, _Recorder, torch.Tensor, Any, Any]:
    (attn,), (ffn,) = make_pair(transfer_dtype=name, transfer_dtype_return=back)
    a_rec = _Recorder(attn.transport)  # type: ignore[arg-type]
    f_rec = _Recorder(ffn.transport)  # type: ignore[arg-type]
    hidden = torch.randn(5, HIDDEN).to(torch.bfloat16)
    attn.send_to_ffn(AttentionToFFN(hidden), layer_idx=3)
    batch = ffn.recv_from_attention(timeout_s=10)
    ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
    answer = attn.recv_from_ffn(layer_idx=3, timeout_s=10)
    attn.close()
    ffn.close()
    return a_rec, f_rec, hidden, batch, answer


@pytest.mark.parametrize(
    ("name", "elements", "scales", "columns", "wire_bytes"),
    [
        ("fp8", "float8_e4m3fn", "float32", 1, 5 * (HIDDEN + 4)),
        ("mxfp8", "float8_e4m3fn", "uint8", 2, 5 * (HIDDEN + 2)),
        ("int8", "int8", "float32", 1, 5 * (HIDDEN + 4)),
    ],
)
def test_a_quantized_message_carries_8_bit_elements_and_its_scales(
    name: str, elements: str, scales: str, columns: int, wire_bytes: int
) -> None:
    a_rec, f_rec, hidden, batch, answer = _round(name, name)
    for rec in (a_rec, f_rec):
        [(frame, tensors)] = rec.sent
        assert frame.encoding == (elements, scales, columns)
        assert frame.header.dtype == "bfloat16"  # what the receiver dequantizes to
        assert [str(t.dtype).removeprefix("torch.") for t in tensors] == [elements, scales]
        assert sum(t.numel() * t.element_size() for t in tensors) == wire_bytes
        assert wire_bytes <= 0.55 * 5 * HIDDEN * 2
        words = frame.encode()
        assert len(words) == FRAME_LEN and Frame.decode(words) == frame
    # the receivers see the model dtype, within the format's error (mxfp8's saturation:
    # 1/8 of a value; a bf16 rounding on top)
    got = batch.payload.hidden_states
    assert got.dtype == torch.bfloat16 and got.shape == hidden.shape
    bound = 0.13 * hidden.float().abs() + 1e-2 * hidden.float().abs().amax(1, keepdim=True)
    assert ((got.float() - hidden.float()).abs() <= bound).all()
    assert answer.output.dtype == torch.bfloat16
    assert ((answer.output.float() - 2 * got.float()).abs() <= 2 * bound).all()


def test_model_transfer_hands_the_payload_tensors_to_the_transport_untouched() -> None:
    a_rec, _, hidden, batch, _ = _round("model", "model")
    [(frame, tensors)] = a_rec.sent
    assert frame.encoding is None and frame.encode()[10:] == [0] * 6
    assert len(tensors) == 1 and tensors[0] is not None
    assert tensors[0].data_ptr() == hidden.data_ptr()  # no copy, no cast
    assert torch.equal(batch.payload.hidden_states, hidden)


def test_each_direction_follows_its_own_setting() -> None:
    a_rec, f_rec, _, _, answer = _round("mxfp8", "model")
    assert a_rec.sent[0][0].encoding is not None
    assert f_rec.sent[0][0].encoding is None
    assert f_rec.sent[0][1][0].dtype == torch.bfloat16
    assert answer.output.dtype == torch.bfloat16


def test_a_frame_with_an_encoding_no_format_has_is_refused() -> None:
    (attn,), (ffn,) = make_pair()
    header = make_header(0, 0, 2, HIDDEN, "bfloat16", PayloadKind.HIDDEN)
    frame = Frame(header, None, attn.global_rank, ("int8", "uint8", 2))  # int8 + E8M0
    ctx = attn._context(ffn.global_rank, 10.0, "sending to", 0)
    tensors = [torch.zeros(2, HIDDEN, dtype=torch.int8), torch.zeros(2, 2, dtype=torch.uint8)]
    attn.transport.send(ctx, [(ffn.global_rank, frame, tensors)])
    with pytest.raises(AFDTransferMismatchError, match="no transfer dtype sends int8 elements"):
        ffn.recv_from_attention(timeout_s=10)
    attn.close()
    ffn.close()
