"""Import hygiene and packaging: no torch / Ascend library at import, entry points resolve."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from afd_core.connector import AFDConnector

_PACKAGE = Path(__file__).resolve().parents[1]
_SUBMODULES = (
    "ops",
    "routing",
    "validation",
    "exchange",
    "camp2p",
    "camasync",
    "layout",
    "testing",
    "vendor",
)
_FORBIDDEN = ("torch", "torch_npu", "vllm", "vllm_ascend", "afd_cam")


def _imported_after(code: str) -> list[str]:
    check = (
        f"{code}\nimport sys\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {_FORBIDDEN!r}))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return list(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


def test_importing_the_package_imports_no_torch_and_no_ascend_library() -> None:
    assert _imported_after("import afd_connectors_npu") == []


def test_importing_every_submodule_imports_no_torch_and_no_ascend_library() -> None:
    code = "\n".join(f"import afd_connectors_npu.{m}" for m in _SUBMODULES)
    code += "\nimport afd_connectors_npu as p\np.CAMP2pAFDConnector, p.CAMAsyncAFDConnector"
    assert _imported_after(code) == []


def test_entry_points_name_the_connector_classes() -> None:
    data = tomllib.loads((_PACKAGE / "pyproject.toml").read_text())
    eps = data["project"]["entry-points"]["afd.connectors"]
    assert set(eps) == {"CAMP2pAFDConnector", "CAMAsyncAFDConnector"}
    import importlib

    for name, target in eps.items():
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert issubclass(cls, AFDConnector) and cls.name == name


def test_lazy_exports_resolve() -> None:
    import afd_connectors_npu

    for name in afd_connectors_npu.__all__:
        assert getattr(afd_connectors_npu, name) is not None
