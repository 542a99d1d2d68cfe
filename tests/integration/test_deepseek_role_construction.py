"""Role-aware DeepSeek wrappers, built and loaded by real vLLM (CPU) from a tiny checkpoint.

Each case runs in a fresh interpreter: vLLM keeps process-global state (distributed
groups, the layer registry) that one model build per process keeps honest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]

BUILD = textwrap.dedent(
    """
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor import Executor

    model_dir, arch, afd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = EngineArgs(
        model=model_dir, hf_overrides={"architectures": [arch]},
        additional_config={"afd": afd}, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, gpu_memory_utilization=0.1,
        distributed_executor_backend="uni",
        worker_extension_cls="afd.ffn_server.AFDWorkerExtension",
    ).create_engine_config()
    executor = Executor.get_class(cfg)(cfg)
    try:
        inventory = executor.collective_rpc("afd_inventory")[0]
        names = executor.collective_rpc("afd_parameter_names")[0]
        print("RESULT " + json.dumps({"inventory": inventory, "names": names}))
    finally:
        executor.shutdown()
    """
)


def build(model_dir: Path, arch: str, afd: dict[str, object], tmp_path: Path) -> dict:
    env = {**os.environ, "TMPDIR": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, str(model_dir), arch, json.dumps(afd)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


CASES = [
    ("deepseek_v2", "AFDDeepseekV2ForCausalLM", False),
    ("deepseek_v3", "AFDDeepseekV3ForCausalLM", True),
]


@pytest.mark.parametrize(("arch", "alias", "gate_on_attention"), CASES)
def test_attention_role_holds_no_ffn_parameters(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str, alias: str, gate_on_attention: bool
) -> None:
    afd = {
        "role": "attention",
        "connector": "LoopbackAFDConnector",
        "port": 1,
        "compute_gate_on_attention": gate_on_attention,
    }
    result = build(tiny_models[arch], alias, afd, tmp_path)
    names = result["names"]
    assert not [n for n in names if ".experts." in n or "shared_expert" in n]
    assert not [n for n in names if ".mlp." in n and ".mlp.gate." not in n]
    gates = [n for n in names if ".mlp.gate." in n]
    assert bool(gates) == gate_on_attention, gates
    assert any(".self_attn." in n for n in names)
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    assert result["inventory"].get("routed_experts", 0) == 0


@pytest.mark.parametrize(("arch", "alias", "gate_on_attention"), CASES)
def test_ffn_role_holds_no_attention_parameters(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str, alias: str, gate_on_attention: bool
) -> None:
    afd = {"role": "ffn", "compute_gate_on_attention": gate_on_attention}
    result = build(tiny_models[arch], alias, afd, tmp_path)
    names = result["names"]
    assert not [n for n in names if ".self_attn." in n or "embed_tokens" in n or "lm_head" in n]
    assert any(".mlp.experts." in n for n in names)
    assert any(".mlp.shared_experts." in n for n in names)
    assert any(".mlp.gate_up_proj." in n for n in names)  # the dense layer 0
    assert result["inventory"].get("attention", 0) == 0
