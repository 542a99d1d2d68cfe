"""Nothing below the edge reads raw ``afd`` keys (issue 42).

The ``additional_config["afd"]`` section and the ``[afd]`` table of a launch spec are
parsed ONCE, at the edge, into a typed :class:`afd_core.config.AFDConfig` (aliases such
as ``num_afd_stages`` resolved there); everything else reads the typed fields. This test
scans every module under ``packages/*/src`` for reads of raw AFD keys:

* any key read (``x["k"]``, ``x.get("k")``, ``x.pop("k")``, ``"k" in x``) on something
  named like an AFD section (``afd``, ``spec.afd``, ``afd_section``...);
* a read of an AFD-specific setting's name (an :class:`AFDConfig` field or an upstream
  alias, e.g. ``["num_micro_batches"]``, ``.get("num_afd_stages")``) on anything;
* a read of the ``"afd"`` key (or ``ADDITIONAL_CONFIG_KEY``) of something named like a
  config (``additional_config["afd"]``, ``additional.get("afd")``).

Only the modules in :data:`EDGE` may do so, each for the reason given there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from afd_core.config import CONFIG_ALIASES, AFDConfig

ROOT = Path(__file__).resolve().parents[2]

EDGE = {
    "afd-core/src/afd_core/config.py": "the parser: reads the section, resolves the aliases",
    "afd-connectors-gpu/src/afd_connectors_gpu/testing.py": (
        "the conformance harness assembles each test process's section from its overrides"
    ),
    "afd-meta/src/afd/tools/bench_report.py": (
        "reads bench result files, whose 'afd' and 'num_micro_batches' are result columns"
    ),
}
"""Modules allowed to read raw keys (path under packages/ -> why)."""

# Field names too generic to flag on any receiver (a node's "host", a message's "role"):
# flagged only on a receiver named like an AFD section.
GENERIC = {"role", "connector", "host", "port", "rank"}
SPECIFIC = (set(AFDConfig.field_names()) | set(CONFIG_ALIASES)) - GENERIC
SECTION_RECEIVER = re.compile(r"(^|[._])afd(_section|_table|_settings)?$")
CONFIG_RECEIVER = re.compile(r"additional|config", re.IGNORECASE)
READ_METHODS = {"get", "pop", "setdefault"}
SECTION_KEY = "<ADDITIONAL_CONFIG_KEY>"  # the constant's name, on any receiver


def _key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return SECTION_KEY if name == "ADDITIONAL_CONFIG_KEY" else None
    return None


def _raw_read(receiver: ast.AST, key: str) -> bool:
    text = ast.unparse(receiver)
    if key == SECTION_KEY or SECTION_RECEIVER.search(text):
        return True
    if key in SPECIFIC:
        return True
    return key == "afd" and bool(CONFIG_RECEIVER.search(text))


def raw_reads(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every raw AFD key read in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load | ast.Del):
            pairs.append((node.value, node.slice))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in READ_METHODS
            and node.args
        ):
            pairs.append((node.func.value, node.args[0]))
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
        ):
            pairs.append((node.comparators[0], node.left))
        for receiver, key_node in pairs:
            key = _key(key_node)
            if key is not None and _raw_read(receiver, key):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_the_scanner_catches_what_it_is_for() -> None:
    caught = [
        'vllm_config.additional_config["afd"]',
        'additional.get("afd") or {}',
        "extra[ADDITIONAL_CONFIG_KEY]",
        'spec.afd.get("connector")',
        'afd.get("num_micro_batches", 1)',
        'int(section["num_afd_stages"])',
        '"micro_batch_min_tokens" in overrides',
        'afd_section.get("role")',
    ]
    for code in caught:
        assert raw_reads(code), code
    left = [
        "afd.num_micro_batches",
        'results["afd"]',
        'node["host"]',
        'level["tok_s"]',
        'd = {"num_micro_batches": 2}',
        'lv["num_micro_batches"] = 2',
    ]
    for code in left:
        assert not raw_reads(code), code


def test_every_edge_module_exists() -> None:
    for path in EDGE:
        assert (ROOT / "packages" / path).is_file(), f"EDGE names a missing module: {path}"


def test_nothing_below_the_edge_reads_raw_afd_keys() -> None:
    offenders = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        rel = path.relative_to(ROOT / "packages").as_posix()
        if rel in EDGE:
            continue
        for line, code in raw_reads(path.read_text()):
            offenders.append(f"packages/{rel}:{line}: {code}")
    assert not offenders, (
        "raw afd keys read below the edge (read the typed AFDConfig instead: "
        "afd_core.config.afd_config_of, DeploymentSpec.afd):\n" + "\n".join(offenders)
    )
