"""Connector registry: entry points, in-process registration, lazy loading."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import AFDConfigError, UnknownConnectorError
from afd_core.registry import (
    ENTRY_POINT_GROUP,
    available_connectors,
    create_connector,
    get_connector_class,
    register_connector,
    unregister_connector,
)
from afd_core.testing.null import NullConnector

CONNECTOR_SOURCE = """
from afd_core.connector import AFDConnector

IMPORTED = True


class FakeEntryPointConnector(AFDConnector):
    name = "FakeEntryPointConnector"
    def init(self): pass
    @property
    def is_initialized(self): return False
    def close(self): pass
    def send_to_ffn(self, payload, *, layer_idx, micro_batch_idx=0): pass
    def recv_from_ffn(self, *, layer_idx, micro_batch_idx=0, timeout_s=None):
        raise NotImplementedError
    def recv_from_attention(self, *, timeout_s=None): raise NotImplementedError
    def send_to_attention(self, batch, result): pass


class NotAConnector:
    pass
"""


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed-looking distribution declaring connectors through the entry-point group."""
    module = "afd_fake_connector_pkg"
    (tmp_path / f"{module}.py").write_text(CONNECTOR_SOURCE)
    dist = tmp_path / "afd_fake_connector_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: afd-fake-connector-pkg\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [{ENTRY_POINT_GROUP}]
            FakeEntryPointConnector = {module}:FakeEntryPointConnector
            FakeNotAConnector = {module}:NotAConnector
            FakeMissingModule = afd_no_such_module_xyz:Thing
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop(module, None)


def test_entry_point_connectors_are_listed_without_being_imported(fake_distribution: str) -> None:
    names = available_connectors()
    assert "FakeEntryPointConnector" in names
    assert fake_distribution not in sys.modules  # listing is lazy


def test_entry_point_connector_is_loaded_on_get(fake_distribution: str) -> None:
    cls = get_connector_class("FakeEntryPointConnector")
    assert fake_distribution in sys.modules
    assert issubclass(cls, AFDConnector) and cls.__name__ == "FakeEntryPointConnector"
    assert get_connector_class("FakeEntryPointConnector") is cls


def test_entry_point_that_is_not_a_connector_is_rejected(fake_distribution: str) -> None:
    with pytest.raises(
        AFDConfigError, match=r"expected a subclass of afd_core\.connector\.AFDConnector"
    ):
        get_connector_class("FakeNotAConnector")
    with pytest.raises(AFDConfigError, match="could not load 'afd_no_such_module_xyz:Thing'"):
        get_connector_class("FakeMissingModule")


def test_the_loopback_test_double_is_not_an_installed_connector() -> None:
    pytest.importorskip("torch")
    eps = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "LoopbackAFDConnector" not in eps
    from afd_core.testing.loopback import LoopbackAFDConnector, register_loopback

    unregister_connector(LoopbackAFDConnector.name)
    with pytest.raises(UnknownConnectorError):
        get_connector_class(LoopbackAFDConnector.name)
    register_loopback()
    register_loopback()  # again: nothing happens
    assert get_connector_class(LoopbackAFDConnector.name) is LoopbackAFDConnector


def test_unknown_connector_lists_installed_names() -> None:
    register_connector("NullConnector", NullConnector)
    try:
        with pytest.raises(UnknownConnectorError) as info:
            get_connector_class("NoSuchConnector")
        message = str(info.value)
        assert "unknown connector 'NoSuchConnector'" in message
        assert "NullConnector" in message
        assert "\n" not in message
        assert isinstance(info.value, LookupError) and isinstance(info.value, AFDConfigError)
    finally:
        unregister_connector("NullConnector")


def test_register_connector_is_idempotent_and_refuses_a_different_target() -> None:
    register_connector("NullConnector", NullConnector)
    try:
        register_connector("NullConnector", NullConnector)
        register_connector("NullConnector", f"{NullConnector.__module__}:NullConnector")
        with pytest.raises(AFDConfigError, match="already registered"):
            register_connector("NullConnector", "somewhere.else:Other")
        assert get_connector_class("NullConnector") is NullConnector
        assert "NullConnector" in available_connectors()
    finally:
        unregister_connector("NullConnector")
    assert "NullConnector" not in available_connectors()


def test_register_string_target_is_resolved_lazily() -> None:
    register_connector("LazyNull", "afd_lazy_module_not_imported_yet:Thing")
    try:
        assert "LazyNull" in available_connectors()
        with pytest.raises(AFDConfigError, match="could not load"):
            get_connector_class("LazyNull")
    finally:
        unregister_connector("LazyNull")


@pytest.mark.parametrize("target", ["no_colon", 42, int])
def test_register_rejects_bad_targets(target: object) -> None:
    with pytest.raises(AFDConfigError):
        register_connector("Bad", target)  # type: ignore[arg-type]


def test_create_connector_builds_the_configured_class() -> None:
    register_connector("NullConnector", NullConnector)
    try:
        config = AFDConfig(role=AFDRole.FFN, connector="NullConnector", num_ffn_ranks=2)
        conn = create_connector(config, rank=1)
        assert isinstance(conn, NullConnector)
        assert (conn.rank, conn.role, conn.topology.num_ffn_ranks) == (1, AFDRole.FFN, 2)
        with pytest.raises(AFDConfigError, match="connector rank 2 is outside"):
            create_connector(config, rank=2)
        extra = AFDConfig(
            role=AFDRole.FFN, connector="NullConnector", connector_extra_config={"x": 1}
        )
        with pytest.raises(AFDConfigError, match="takes no extra options"):
            create_connector(extra, rank=0)
    finally:
        unregister_connector("NullConnector")
