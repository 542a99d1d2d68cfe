"""``afd serve --role attention`` picks the AFD worker only when the role micro-batches."""

from __future__ import annotations

import json

import pytest

from afd.runtime.serve import attention_worker_args


def _argv(afd: dict[str, object]) -> list[str]:
    return ["--model", "m", "--additional-config", json.dumps({"afd": afd})]


@pytest.mark.parametrize(("cuda", "worker"), [(False, "AFDCPUWorker"), (True, "AFDGPUWorker")])
def test_micro_batching_adds_the_afd_worker(cuda: bool, worker: str) -> None:
    argv = _argv({"role": "attention", "num_micro_batches": 2})
    assert attention_worker_args(argv, cuda=cuda) == [
        "--worker-cls",
        f"afd.runtime.worker.{worker}",
    ]
    assert "--additional-config" in argv  # the probe does not consume the caller's args


def test_the_upstream_alias_num_afd_stages_adds_the_worker_too() -> None:
    argv = _argv({"role": "attention", "num_afd_stages": 2})
    assert attention_worker_args(argv, cuda=False) == [
        "--worker-cls",
        "afd.runtime.worker.AFDCPUWorker",
    ]


def test_one_micro_batch_or_an_explicit_worker_adds_nothing() -> None:
    assert attention_worker_args(_argv({"role": "attention"}), cuda=False) == []
    explicit = [*_argv({"num_micro_batches": 3}), "--worker-cls", "my.Worker"]
    assert attention_worker_args(explicit, cuda=False) == []


def test_micro_batches_of_reads_the_attention_role_only() -> None:
    from types import SimpleNamespace

    from afd.runtime.worker import micro_batches_of

    def cfg(afd: dict[str, object]) -> object:
        return SimpleNamespace(additional_config={"afd": afd})

    assert micro_batches_of(cfg({"role": "attention", "num_micro_batches": 3})) == 3
    assert micro_batches_of(cfg({"role": "ffn", "num_micro_batches": 3})) == 1
    assert micro_batches_of(SimpleNamespace(additional_config={})) == 1


def test_compiled_attention_on_cuda_gets_piecewise_graphs_unless_configured() -> None:
    import json

    from afd.runtime.serve import CUDA_ATTENTION_COMPILATION, attention_graph_args

    argv = ["--model", "/m", "--additional-config", json.dumps({"afd": {"role": "attention"}})]
    assert attention_graph_args(argv, cuda=True) == [
        "--compilation-config",
        json.dumps(CUDA_ATTENTION_COMPILATION),
    ]
    assert CUDA_ATTENTION_COMPILATION == {"cudagraph_mode": "PIECEWISE"}
    # CPU: vLLM's default compile mode has no CUDA graphs; nothing to add.
    assert attention_graph_args(argv, cuda=False) == []
    # Eager, or a compilation config of the user's own (any spelling): left alone.
    for extra in (
        ["--enforce-eager"],
        ["--compilation-config", "{}"],
        ['--compilation-config={"mode": 0}'],
        ["-cc", "{}"],
        ["-cc.cudagraph_mode=NONE"],
        ["-O3"],
    ):
        assert attention_graph_args([*argv, *extra], cuda=True) == [], extra


def test_ffn_expert_parallel_switch_goes_into_the_afd_section() -> None:
    from afd.runtime.serve import prepare_role_args

    args = prepare_role_args(
        "ffn",
        "m",
        ["--ffn-expert-parallel", "--hf-overrides", '{"architectures": ["AFDQwen3MoeForCausalLM"]}',
         "--additional-config", json.dumps({"afd": {"num_ffn_ranks": 2, "rank": 1}})],
    )  # fmt: skip
    assert "--ffn-expert-parallel" not in args
    afd = json.loads(args[args.index("--additional-config") + 1])["afd"]
    assert afd == {"num_ffn_ranks": 2, "rank": 1, "role": "ffn", "ffn_expert_parallel": True}


def test_the_runtime_registers_its_worker_table_for_the_models_check() -> None:
    from afd.runtime.worker import FORMER_NAMES, WORKERS, register_workers
    from afd_moe_runners.worker_table import is_micro_batch_worker, micro_batch_worker

    register_workers()
    assert WORKERS["cpu"] == "afd.runtime.worker.AFDCPUWorker"
    assert micro_batch_worker("cpu") == WORKERS["cpu"]
    assert micro_batch_worker("cuda") == WORKERS["cuda"]
    assert all(is_micro_batch_worker(name) for name in (*WORKERS.values(), *FORMER_NAMES))
    assert not is_micro_batch_worker("vllm.v1.worker.cpu_worker.CPUWorker")


def test_prepare_role_hands_vllm_the_section_in_canonical_keys() -> None:
    from afd.runtime.serve import prepare_role

    afd, args = prepare_role(
        "attention",
        "m",
        ["--hf-overrides", '{"architectures": ["AFDQwen3MoeForCausalLM"]}',
         "--additional-config", json.dumps({"afd": {"num_afd_stages": 2, "afd_port": 4000}})],
    )  # fmt: skip
    assert afd.num_micro_batches == 2 and afd.port == 4000
    section = json.loads(args[args.index("--additional-config") + 1])["afd"]
    assert section == {"role": "attention", "port": 4000, "num_micro_batches": 2}
    assert attention_worker_args(args, cuda=False, afd=afd) == [
        "--worker-cls",
        "afd.runtime.worker.AFDCPUWorker",
    ]


def test_prepare_role_reads_the_role_under_its_alias_too() -> None:
    from afd.runtime.serve import prepare_role
    from afd_core.errors import AFDConfigError

    hf = ["--hf-overrides", '{"architectures": ["AFDQwen3MoeForCausalLM"]}']
    with pytest.raises(AFDConfigError, match=r"--role attention conflicts with afd\.role='ffn'"):
        prepare_role("attention", "m", [*hf, "--additional-config", '{"afd": {"afd_role": "ffn"}}'])
    afd, _ = prepare_role(
        "attention", "m", [*hf, "--additional-config", '{"afd": {"afd_role": "attention"}}']
    )
    assert afd.role.value == "attention"


def test_the_ffn_role_checks_then_drops_a_speculative_config() -> None:
    """vLLM's own EngineArgs, as the FFN server parses them: n-gram and MTP are dropped
    (the Attention role speculates; no drafter on the FFN role), other drafters refused."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from afd.runtime.serve import drop_speculation
    from afd_core.errors import AFDConfigError

    def parsed(*args: str) -> EngineArgs:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        return EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *args]))

    ngram = parsed("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert ngram.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    drop_speculation(ngram)
    assert ngram.speculative_config is None and ngram.spec_method is None
    flags = parsed("--spec-method", "ngram", "--spec-tokens", "2")
    drop_speculation(flags)
    assert (flags.spec_method, flags.spec_tokens) == (None, None)
    mtp = parsed("--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
    drop_speculation(mtp)  # MTP runs whole on the Attention role
    assert mtp.speculative_config is None
    with pytest.raises(AFDConfigError, match=r"^afd serve --role ffn: .* method 'eagle3' is not"):
        drop_speculation(parsed("--speculative-config", '{"method": "eagle3", "model": "e"}'))
    plain = parsed()
    drop_speculation(plain)
    assert plain.speculative_config is None
