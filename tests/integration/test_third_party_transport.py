"""A connector written outside afd's packages: a Transport only, over multiprocessing pipes.

Everything the AFD contract asks beyond moving bytes (fan-in, split, header checks,
deadlines, error texts, close) comes from :class:`afd_core.exchange.ExchangeConnector`.
The connector is declared as a third-party package declares it, through an installed
distribution's ``afd.connectors`` entry point (nothing registers it in-process), found
by name through afd_core.registry, and passes the whole conformance suite, run the way
the suite runs the loopback double (one thread per rank).
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from afd_core import registry
from afd_core.exchange import ExchangeConnector, TransferContext, Transport
from afd_core.testing.conformance import Scenario, conformance_cases, run_scenario
from afd_core.testing.loopback import LoopbackHarness
from afd_core.topology import AFDTopology
from afd_core.wire import Frame

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


#: This module as the target of the distribution's entry point (pytest imports it by
#: this name: a third-party package's module name in a deployment).
TARGET = f"{__name__}:PipeAFDConnector"


@pytest.fixture(scope="module", autouse=True)
def installed_distribution(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """An installed-looking third-party distribution declaring PipeAFDConnector in the
    entry-point group its pyproject.toml names: ``[project.entry-points."afd.connectors"]``."""
    site = tmp_path_factory.mktemp("site-packages")
    dist = site / "afd_pipe_connector-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: afd-pipe-connector\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[afd.connectors]\nPipeAFDConnector = {TARGET}\n")
    with pytest.MonkeyPatch.context() as mp_:
        mp_.syspath_prepend(str(site))
        registry.unregister_connector(PipeAFDConnector.name)  # found by its entry point only
        yield
        registry.unregister_connector(PipeAFDConnector.name)  # forget the loaded class


def test_the_third_party_connector_is_found_by_name_through_its_entry_point() -> None:
    """What a deployment does with ``additional_config["afd"]["connector"]``: the name
    alone finds the installed package's class."""
    assert sys.modules[__name__].PipeAFDConnector is PipeAFDConnector  # the target's module
    group = importlib.metadata.entry_points(group="afd.connectors")
    assert [ep.value for ep in group if ep.name == PipeAFDConnector.name] == [TARGET]
    registry.unregister_connector(PipeAFDConnector.name)  # no class loaded before: look it up
    assert PipeAFDConnector.name in registry.available_connectors()
    assert registry.get_connector_class(PipeAFDConnector.name) is PipeAFDConnector


@pytest.mark.parametrize(("scenario", "topology"), conformance_cases())
def test_third_party_transport_passes_conformance(
    scenario: Scenario, topology: AFDTopology
) -> None:
    run_scenario(LoopbackHarness(PipeAFDConnector.name, host="pipes"), scenario, topology)
