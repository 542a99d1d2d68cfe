"""``[prefill]`` in a launch spec (prefill/decode disaggregation, AFD on the decode side):
the table's checks, the processes it adds and the proxy's request layout."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from afd.launch import Deployment, DeploymentSpec, RoleProcess, SpecError
from afd.launch.pd_proxy import (
    ProxyRequestError,
    decode_request,
    join_completions,
    prefill_request,
)
from afd.launch.pd_proxy import _check as check_request


def _built(spec: DeploymentSpec, tmp_path: Path) -> dict[str, RoleProcess]:
    """The processes ``Deployment.start`` would start (commands and envs only)."""
    dep = Deployment(spec, console=io.StringIO(), visible_devices=[], usable_cpus=[0, 1])
    dep.work_dir = dep.log_dir = tmp_path
    dep.http_ports, dep.connector_port = [18000], 18001
    dep.pd_ports = [18002, 18003]
    dep._build_roles()
    return {r.name: r for r in dep.roles}


def _kv_config(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_prefill_adds_a_producer_a_consumer_and_the_proxy_on_the_deployment_port(
    tmp_path: Path,
) -> None:
    spec = DeploymentSpec(model="/m", prefill={"vllm_args": ["--max-num-seqs", "4"]})
    roles = _built(spec, tmp_path)
    assert list(roles) == ["ffn0", "prefill0", "attn", "proxy"]
    prefill, attn, proxy = roles["prefill0"], roles["attn"], roles["proxy"]
    assert prefill.cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--max-num-seqs" in prefill.cmd and "--max-num-seqs" not in attn.cmd
    producer, consumer = _kv_config(prefill.cmd), _kv_config(attn.cmd)
    assert (producer["kv_role"], consumer["kv_role"]) == ("kv_producer", "kv_consumer")
    # afd's connector (every prompt token), loaded by vLLM from afd's runtime package
    assert producer["kv_connector"] == consumer["kv_connector"] == "WholePromptConnector"
    for config in (producer, consumer):
        assert config["kv_connector_module_path"] == "afd.runtime.kv_connector"
    path = producer["kv_connector_extra_config"]["shared_storage_path"]
    assert consumer["kv_connector_extra_config"]["shared_storage_path"] == path
    assert Path(path) == Path(prefill.env["TMPDIR"]) / "kv"  # the deployment's, removed at stop
    assert (prefill.http_url, attn.http_url) == ("http://127.0.0.1:18003", "http://127.0.0.1:18002")
    assert proxy.http_url == "http://127.0.0.1:18000"
    assert proxy.cmd[proxy.cmd.index("--prefill") + 1] == prefill.http_url
    assert proxy.cmd[proxy.cmd.index("--decode") + 1] == attn.http_url
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == attn.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert "--kv-transfer-config" not in roles["ffn0"].cmd


def test_without_prefill_nothing_changes(tmp_path: Path) -> None:
    roles = _built(DeploymentSpec(model="/m"), tmp_path)
    assert list(roles) == ["ffn0", "attn"] and "--kv-transfer-config" not in roles["attn"].cmd
    assert roles["attn"].http_url == "http://127.0.0.1:18000"


def test_a_native_baseline_ignores_prefill(tmp_path: Path) -> None:
    roles = _built(DeploymentSpec(model="/m", native=True, prefill={}), tmp_path)
    assert list(roles) == ["native0"] and "--kv-transfer-config" not in roles["native0"].cmd


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill": {"kv_conector": "x"}}, "prefill: unknown key 'kv_conector' (did you mean"),
        (
            {"prefill": {"kv_connector": "NixlConnector"}},
            "prefill.kv_connector: 'NixlConnector' is not supported by afd launch; use "
            "'WholePromptConnector' or 'ExampleConnector'",
        ),
        (
            {"prefill": {}, "vllm_args": ["--kv-transfer-config", "{}"]},
            "vllm_args: --kv-transfer-config is set by the launcher from [prefill]",
        ),
        (
            {"prefill": {"vllm_args": ["--kv-transfer-config={}"]}},
            "prefill.vllm_args: --kv-transfer-config is set by the launcher",
        ),
        ({"prefill": {}, "ray": {}}, "prefill: [prefill] runs on this host"),
        ({"prefill": "yes"}, "prefill: expected a table, got 'yes'"),
    ],
)
def test_bad_prefill_tables_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(SpecError) as refused:
        DeploymentSpec(model="/m", **kwargs)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_prefill_with_an_mla_model_on_the_cpu_build_needs_the_whole_prompt_connector(
    tmp_path: Path,
) -> None:
    from afd.runtime.environment import installed_version

    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    if installed_version("vllm-cpu") is None:
        pytest.skip("the refusal is vllm-cpu's (not installed)")
    example = {"kv_connector": "ExampleConnector"}
    with pytest.raises(SpecError, match=r"^prefill: an MLA model .* 'WholePromptConnector'"):
        DeploymentSpec(model=str(model), prefill=example)
    DeploymentSpec(model=str(model), prefill={})  # afd's connector, the default
    DeploymentSpec(model=str(model), prefill=example, native=True)  # the baseline ignores it
    (model / "config.json").write_text(json.dumps({"num_key_value_heads": 2}))
    DeploymentSpec(model=str(model), prefill=example)


def test_vllms_example_connector_is_named_without_a_module_path(tmp_path: Path) -> None:
    spec = DeploymentSpec(model="/m", prefill={"kv_connector": "ExampleConnector"})
    roles = _built(spec, tmp_path)
    for name in ("prefill0", "attn"):
        config = _kv_config(roles[name].cmd)
        assert config["kv_connector"] == "ExampleConnector"
        assert "kv_connector_module_path" not in config


def test_a_prefill_spec_writes_the_file_that_builds_it_again(tmp_path: Path) -> None:
    for table in ({}, {"cpus": "1", "kv_connector_extra_config": {"shared_storage_path": "/kv"}}):
        spec = DeploymentSpec(model="/m", prefill=table)
        path = tmp_path / "spec.toml"
        path.write_text(spec.to_toml())
        again = DeploymentSpec.from_toml(path)
        assert again.prefill == spec.prefill and again.prefill is not None
    assert "prefill" not in DeploymentSpec(model="/m").to_dict()


# ------------------------------------------------------------------ the proxy's layout


def test_the_prefill_request_asks_one_token_and_its_ids() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 32, "temperature": 0.0, "min_tokens": 5}
    assert prefill_request(body) == {**body, "max_tokens": 1, "min_tokens": 1,
                                     "return_token_ids": True, "stream": False}  # fmt: skip


def test_the_decode_request_is_the_prompt_ids_plus_the_first_token() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 32, "ignore_eos": True}
    ask = decode_request(body, [1, 7, 9], [42])
    assert ask["prompt"] == [1, 7, 9, 42] and ask["max_tokens"] == 31 and ask["ignore_eos"]
    assert decode_request({"prompt": "x"}, [1], [2])["max_tokens"] == 15  # vLLM's default 16


def test_the_answer_is_one_completion_of_the_original_prompt() -> None:
    body = {"prompt": "hi", "max_tokens": 4, "return_token_ids": True}
    first = {
        "text": "A",
        "token_ids": [42],
        "prompt_token_ids": [1, 7, 9],
        "finish_reason": "length",
    }
    rest = {"text": "BCD", "token_ids": [5, 6, 8], "prompt_token_ids": [1, 7, 9, 42],
            "finish_reason": "length"}  # fmt: skip
    prefilled = {"id": "p", "choices": [first]}
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    decoded = {"id": "d", "choices": [rest], "usage": usage}
    out = join_completions(body, prefilled, decoded)
    choice = out["choices"][0]
    assert (choice["text"], choice["token_ids"]) == ("ABCD", [42, 5, 6, 8])
    assert choice["prompt_token_ids"] == [1, 7, 9] and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    plain = join_completions({"prompt": "hi"}, prefilled, decoded)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "stream": True}, "streaming is not served by the afd PD proxy"),
        ({"prompt": "x", "n": 2}, "n = 1 only"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": "x", "logprobs": 1}, "logprobs is not served"),
        ([], "expected a JSON object"),
    ],
)
def test_requests_the_proxy_does_not_serve_are_refused(body: object, message: str) -> None:
    with pytest.raises(ProxyRequestError, match=message):
        check_request(body)
