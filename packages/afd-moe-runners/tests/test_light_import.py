"""``import afd_moe_runners`` stays light: no torch, no vLLM until a runner is used."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_torch_or_vllm() -> None:
    code = (
        "import sys, afd_moe_runners\n"
        "heavy = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'FFNLayerCompute' in dir(afd_moe_runners)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_micro_batch_threads_import_without_vllm() -> None:
    # tools/gpu_check.py probes them on a GPU host that has torch but no vLLM.
    code = "import sys, afd_moe_runners.micro_batch_threads\nassert 'vllm' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_attribute_is_an_attribute_error() -> None:
    import pytest

    import afd_moe_runners

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        afd_moe_runners.Nope  # noqa: B018
