"""A connector written outside afd's packages: a Transport only, over multiprocessing pipes.

Everything the AFD contract asks beyond moving bytes (fan-in, split, header checks,
deadlines, error texts, close) comes from :class:`afd_core.exchange.ExchangeConnector`.
The connector is registered by name and passes the whole conformance suite, run the
way the suite runs the loopback double (one thread per rank).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from afd_core.exchange import ExchangeConnector, TransferContext, Transport  # noqa: E402
from afd_core.registry import register_connector  # noqa: E402
from afd_core.testing.conformance import Scenario, conformance_cases, run_scenario  # noqa: E402
from afd_core.testing.loopback import LoopbackHarness  # noqa: E402
from afd_core.topology import AFDTopology  # noqa: E402
from afd_core.wire import Frame  # noqa: E402

_POLL_S = 0.02
_pipes: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # (address, src, dst) -> ends
_lock = threading.Lock()


class PipeTransport(Transport):
    """One duplex pipe per directed (sender, receiver) pair; a message is
    ``(frame words, tensors)`` pickled through it."""

    def connect(self) -> None:
        c = self.connector
        with _lock:
            ends = {
                (src, dst): _pipes.setdefault((c.where, src, dst), mp.Pipe())
                for p in c.peers
                for src, dst in ((c.global_rank, p), (p, c.global_rank))
            }
        self._tx = {p: ends[(c.global_rank, p)][0] for p in c.peers}
        self._rx = {p: ends[(p, c.global_rank)][1] for p in c.peers}
        self._current: dict[int, tuple[Frame, list[Any]]] = {}
        self.ready = True

    def close(self) -> None:
        c = self.connector
        peer = c.goodbye()
        if self.ready and peer is not None:
            self._tx[peer].send((Frame.shutdown(c.global_rank).words, []))
        for tx in getattr(self, "_tx", {}).values():
            tx.close()  # the peer's receive sees EOF: this side is gone
        self.ready = False

    def send(self, ctx: TransferContext, messages: Any) -> None:
        for peer, frame, tensors in messages:
            self._tx[peer].send((frame.words, [t.contiguous() for t in tensors]))

    def recv_frame(self, ctx: TransferContext) -> Frame:
        if ctx.peer in self._current:
            return self._current[ctx.peer][0]
        rx = self._rx[ctx.peer]
        while not rx.poll(min(_POLL_S, ctx.remaining())):
            if self.connector.closed:
                raise ctx.closed_error()
            if ctx.remaining() == 0:
                raise ctx.timeout_error()
        try:
            words, tensors = rx.recv()
        except (EOFError, OSError):
            ctx.break_peer("its pipe closed")
            raise ctx.lost_error("its pipe closed") from None
        frame = ctx.decode_frame(words)
        self._current[ctx.peer] = (frame, tensors)
        return frame

    def recv_tensors(self, ctx: TransferContext, parts: Any, specs: Any) -> list[Any]:
        got = [self._current.pop(peer)[1] for peer, _ in parts]
        if len(got) == 1:
            return got[0]
        return [torch.cat(rows, dim=0) for rows in zip(*got, strict=True)]


class PipeAFDConnector(ExchangeConnector):
    name = "PipeAFDConnector"
    transport_class = PipeTransport


register_connector(PipeAFDConnector.name, PipeAFDConnector)


@pytest.mark.parametrize(("scenario", "topology"), conformance_cases())
def test_third_party_transport_passes_conformance(
    scenario: Scenario, topology: AFDTopology
) -> None:
    run_scenario(LoopbackHarness(PipeAFDConnector.name, host="pipes"), scenario, topology)


def test_a_transport_needs_only_the_byte_moving_calls() -> None:
    """What a third-party transport overrides is the small interface, nothing else."""
    own = {n for n in vars(PipeTransport) if not n.startswith("__")}
    assert own == {"connect", "close", "send", "recv_frame", "recv_tensors"}
