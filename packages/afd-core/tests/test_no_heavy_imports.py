"""afd-core must stay importable without torch or vLLM being imported."""

from __future__ import annotations

import subprocess
import sys

# Every afd_core module except the torch-based testing kit (afd_core.testing itself is light).
CODE = """
import importlib, pkgutil, sys
import afd_core
names = ['afd_core', 'afd_core.testing']
for info in pkgutil.walk_packages(afd_core.__path__, 'afd_core.'):
    if not info.name.startswith('afd_core.testing.'):
        names.append(info.name)
for name in names:
    importlib.import_module(name)
import afd_core.registry
afd_core.registry.available_connectors()  # listing connectors imports none of them
heavy = sorted(m for m in ('torch', 'vllm') if m in sys.modules)
assert not heavy, f'imported {heavy} via {names}'
assert 'afd_core.config' in names and 'afd_core.weights' in names, names
"""


def test_importing_afd_core_imports_neither_torch_nor_vllm() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
