"""How the suites are cut for two pytest workers (tests/support/afd_workers.py)."""

from __future__ import annotations

from afd_workers import unit_of_work


def test_each_e2e_test_is_a_unit_and_other_modules_stay_whole() -> None:
    e2e = "tests/e2e/test_launch.py::test_2a1f_serves_and_stops_on_sigterm"
    assert unit_of_work(e2e) == e2e
    param = "tests/e2e/test_qwen_parity.py::test_1a1f_greedy_tokens_equal_native[None-ffn]"
    assert unit_of_work(param) == param
    # one Ray cluster per module: its tests stay on one worker
    ray = "tests/e2e/test_ray_launch.py::test_ray_1a1f_parity_then_sigterm_leaves_nothing"
    assert unit_of_work(ray) == "tests/e2e/test_ray_launch.py"
    # module fixtures (harnesses, vLLM configs, probes) are built once: the module is a unit
    for nodeid in (
        "packages/afd-connectors-gpu/tests/test_conformance.py::test_connector_conforms[x]",
        "tests/integration/test_generic_split.py::test_plan_per_layer[deepseek_v2]",
    ):
        assert unit_of_work(nodeid) == nodeid.split("::", 1)[0]
