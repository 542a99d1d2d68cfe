"""afd_core.ports: free ports outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from afd_core.ports import LOWEST, ephemeral_range, free_port, port_bindable


def test_ephemeral_range_is_read_from_the_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_range(str(f)) == (32768, 60999)
    f.write_text("50000 40000")  # not a range
    assert ephemeral_range(str(f)) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_free_port_lies_outside_the_ephemeral_range_and_is_bindable() -> None:
    low, high = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert port >= LOWEST
        assert not low <= port <= high
        assert port_bindable("127.0.0.1", port)


def test_free_port_avoids_taken_and_bound_ports() -> None:
    # a range that leaves exactly two ports outside it: LOWEST and LOWEST + 1
    ephemeral = (LOWEST + 2, 65535)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", LOWEST))
        except OSError:
            pytest.skip(f"port {LOWEST} is in use on this host")
        assert free_port(ephemeral=ephemeral) == LOWEST + 1
        # both taken: the OS picks one
        port = free_port(taken={LOWEST + 1}, ephemeral=ephemeral)
        assert port not in (LOWEST, LOWEST + 1)
        assert port_bindable("127.0.0.1", port)


def test_no_room_outside_the_range_falls_back_to_the_os() -> None:
    port = free_port(ephemeral=(1, 65535))
    assert 0 < port <= 65535
    assert port_bindable("127.0.0.1", port)
