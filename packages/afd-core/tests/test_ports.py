"""afd_core.ports: free ports outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from afd_core.ports import (
    LOWEST,
    RESERVATION_S,
    ephemeral_range,
    free_port,
    port_bindable,
    reservation_dir,
    reserve,
)


@pytest.fixture(autouse=True)
def _own_reservations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test keeps its port reservations to itself (not the host's folder)."""
    folder = tmp_path / "ports"
    monkeypatch.setenv("AFD_PORT_DIR", str(folder))
    return folder


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


def test_a_picked_port_is_not_picked_again_while_reserved() -> None:
    """Two launchers side by side: the second call gets the other free port, though the
    first one is still bindable (its role has not bound it yet); with both reserved the
    OS picks."""
    ephemeral = (LOWEST + 2, 65535)  # two candidates: LOWEST and LOWEST + 1
    if not (port_bindable("127.0.0.1", LOWEST) and port_bindable("127.0.0.1", LOWEST + 1)):
        pytest.skip(f"port {LOWEST} or {LOWEST + 1} is in use on this host")
    first = free_port(ephemeral=ephemeral)
    second = free_port(ephemeral=ephemeral)
    assert {first, second} == {LOWEST, LOWEST + 1}
    assert port_bindable("127.0.0.1", first)  # nobody bound it: only the reservation
    assert (reservation_dir() / str(first)).read_text().strip().isdigit()
    third = free_port(ephemeral=ephemeral)
    assert third not in (LOWEST, LOWEST + 1)


def test_a_reservation_lasts_its_time_then_is_taken_over() -> None:
    assert reserve(LOWEST, now=1000.0)
    assert not reserve(LOWEST, now=1000.0 + 10)
    assert not reserve(LOWEST, now=1000.0 + RESERVATION_S)
    assert reserve(LOWEST, now=1000.0 + RESERVATION_S + 1)  # stale: taken over
    assert not reserve(LOWEST, now=1000.0 + RESERVATION_S + 2)


def test_without_a_writable_folder_ports_are_still_picked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AFD_PORT_DIR", str(blocker / "ports"))  # under a file: no folder
    assert reserve(LOWEST)
    port = free_port()
    assert port_bindable("127.0.0.1", port)
