"""pytest plugin for runs on several xdist workers (the nox sessions pass
``-p afd_workers -n N``; docs/development.md).

How the work is cut: an end-to-end test (``tests/e2e/``) is its own unit of work, so the
two workers share the deployments evenly; every other test module is one unit, so its
module-scoped fixtures (vLLM configs, process harnesses, probe subprocesses, generated
checkpoints) are built once per run, and so is the module's Ray cluster
(``tests/e2e/test_ray_launch.py``). A worker gets its next unit when it has at most one
test left, so the run does not end with one worker holding a queue of deployments while
the other idles; the longest units go first.

(xdist's own ``--dist loadgroup`` cannot do this here: with pytest 9 it no longer
changes the node ids it groups by.)
"""

from __future__ import annotations

from typing import Any

#: e2e modules whose tests share one expensive module fixture: kept on one worker.
E2E_KEPT_TOGETHER = frozenset({"tests/e2e/test_ray_launch.py"})


def unit_of_work(nodeid: str) -> str:
    """The unit a test is scheduled with: itself (an e2e test) or its module."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/e2e/") and module not in E2E_KEPT_TOGETHER:
        return nodeid
    return module


def _weight(item: Any) -> int:
    module = item.nodeid.split("::", 1)[0]
    if module in E2E_KEPT_TOGETHER:
        return 0
    return 1 if module.startswith("tests/e2e/") else 2


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Under xdist, the longest units first (the Ray module, then each end-to-end test,
    then the other modules in their order): the run then ends on short units, not on one
    worker's last deployment while the other worker idles. Every worker sorts alike."""
    if hasattr(config, "workerinput"):
        items.sort(key=_weight)  # stable: a module's tests keep their order


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class AFDScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return AFDScheduling(config, log)
