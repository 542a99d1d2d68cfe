"""afd's KV connector for prefill/decode disaggregation: vLLM's ``ExampleConnector`` with
every prompt token handed over.

``afd launch`` with a ``[prefill]`` table (:mod:`afd.launch.spec_prefill`) names this class
in ``--kv-transfer-config`` on both sides (``kv_connector`` ``WholePromptConnector``,
``kv_connector_module_path`` ``afd.runtime.kv_connector``: vLLM's documented seam for a
connector of one's own). The prefill instance (``kv_producer``) stores the KV cache of
every token of each prompt, the partial last block included; the decode side
(``kv_consumer``: the AFD Attention role) is asked for the prompt plus the prefill's first
token (:mod:`afd.launch.pd_proxy`) and loads the KV of everything but that last token, so
it computes one token per request: the least vLLM's scheduler allows. vLLM 0.32's
scheduler (``Scheduler.schedule``, vllm/v1/core/sched/scheduler.py) schedules
``request.num_tokens - num_computed_tokens`` new tokens with ``num_computed_tokens`` =
local prefix hits + the connector's matched tokens, and asserts that this is above 0: a
connector may hand over at most ``num_tokens - 1`` tokens, the last one is always computed
(it is the one whose logits give the next token).

vLLM's ``ExampleConnector`` hands over whole blocks only (``align_to_block_size``, in its
``ReqMeta.make_meta``, ``get_num_new_matched_tokens`` and ``_found_match_for_prompt``), so
the decode side recomputed each prompt's last partial block. With vLLM CPU's MLA (the
DeepSeek family) that recompute is a prefill over a handed-over context, and its tokens
diverged from native vLLM's (measured, natively too; vLLM's CPU platform turns chunked
prefill and prefix caching off for MLA, so nothing else runs that path); with one token
left the decode side takes vLLM's decode path and gives native's tokens (measured: docs/cli.md,
``[prefill]``). The KV moves in whole blocks, the partial last one included
(:func:`slot_mapping` says why), through ``ExampleConnector``'s own store and load.

What this class replaces of ``ExampleConnector`` (vLLM 0.32; the drift test
packages/afd-meta/tests/test_kv_connector.py pins the upstream sources it was written
against): the token count (``get_num_new_matched_tokens``, ``_found_match_for_request``)
and which requests store or load what (``build_connector_meta``: a rewrite, its body
builds ``ReqMeta`` with the block-aligned ``make_meta`` and cannot be steered). The KV
movement itself (``start_load_kv``, ``save_kv_layer``, the file names) is vLLM's, unchanged.
Unlike vLLM's example, a side stores only as a producer and loads only as a consumer
(``kv_both`` does both), and a prefill computed in several chunks is not stored (the
decode side then computes that prompt itself, correctly, and a warning says so).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "SUPPORTED_VLLM",
    "WholePromptConnector",
    "handed_over",
    "request_meta",
    "slot_mapping",
]

logger = init_logger(__name__)

CONNECTOR_NAME = "WholePromptConnector"
MODULE_PATH = __name__
SUPPORTED_VLLM = (0, 32)
"""The vLLM release line whose ``ExampleConnector`` this class was written against."""


def handed_over(decode_prompt: Sequence[int]) -> list[int]:
    """The tokens whose KV a decode request finds stored: its prompt less the last token
    (the prefill's first token, appended by the proxy), i.e. the prefill's whole prompt."""
    return list(decode_prompt[:-1])


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The KV cache slots of the whole blocks (of ``block_ids``) that hold a request's
    first ``num_tokens`` tokens, the partial last block whole too.

    Whole blocks because ``ExampleConnector`` moves rows of a ``[blocks, heads, block,
    C]`` view (``layer[block, :, offset]``), and in vLLM CPU attention's cache
    (``[blocks, kv heads, block, 2 * head]``, keys then values in each block's memory) row
    ``offset`` is not token ``offset``'s key and value: a row subset of a block moves
    other tokens' halves, a whole block is moved exactly (CPU MLA's slot-indexed cache
    either way). The slots past ``num_tokens`` carry what the producer's block held
    there; the decode side writes its own tokens over them before reading them.
    """
    num_blocks = -(-num_tokens // block_size)
    if num_blocks > len(block_ids):
        raise ValueError(
            f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}"
        )
    blocks = torch.tensor(list(block_ids[:num_blocks]), dtype=torch.long).reshape(-1, 1)
    return (blocks * block_size + torch.arange(block_size, dtype=torch.long)).flatten()


def request_meta(
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    block_size: int,
    is_store: bool,
    mm_hashes: list[str],
) -> ReqMeta:
    """vLLM's ``ReqMeta`` for every one of ``token_ids`` (the file key) and the whole
    blocks that hold them (``ReqMeta.make_meta`` keeps only the whole blocks less one
    token)."""
    return ReqMeta(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long),
        slot_mapping=slot_mapping(block_ids, block_size, len(token_ids)),
        is_store=is_store,
        mm_hashes=mm_hashes,
    )


def _check_vllm_version() -> None:
    parts = str(vllm.__version__).split("+", 1)[0].split(".")
    if tuple(int(p) if p.isdigit() else -1 for p in parts[:2]) != SUPPORTED_VLLM:
        wanted = ".".join(str(p) for p in SUPPORTED_VLLM)
        raise ImportError(
            f"{CONNECTOR_NAME} replaces parts of vLLM {wanted}'s ExampleConnector, found vLLM "
            f"{vllm.__version__}: use kv_connector ExampleConnector, or an afd release built "
            f"for vLLM {vllm.__version__}"
        )


class WholePromptConnector(ExampleConnector):
    """``ExampleConnector`` (KV files in ``shared_storage_path``) that stores and loads
    every prompt token: the decode side computes one token per request (module doc)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        _check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._stores = bool(self._kv_transfer_config.is_kv_producer)
        self._loads = bool(self._kv_transfer_config.is_kv_consumer)

    def _stored(self, token_ids: Sequence[int], mm_hashes: list[str]) -> bool:
        """Whether the KV of exactly ``token_ids`` is in the shared folder."""
        if not token_ids:
            return False
        folder = self._generate_foldername_debug(
            torch.tensor(list(token_ids), dtype=torch.long), mm_hashes, create_folder=False
        )
        return os.path.exists(folder)

    def _found_match_for_request(self, request: Request) -> bool:
        mm_hashes = [f.identifier for f in request.mm_features]
        return self._stored(handed_over(request.prompt_token_ids or []), mm_hashes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # At most num_tokens - 1 (the scheduler computes at least one token): the
        # handed-over prompt is the decode prompt less its last token.
        handed = len(request.prompt_token_ids or []) - 1
        if not self._loads or handed <= num_computed_tokens:
            return 0, False
        if not self._found_match_for_request(request):
            return 0, False
        return handed - num_computed_tokens, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # Rewritten (vLLM 0.32's builds ReqMeta.make_meta's whole blocks): loads the
        # handed-over prompt of each request update_state_after_alloc marked, stores each
        # new request's whole prompt when it is computed in this step.
        meta = ExampleConnectorMetadata()
        size = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            mm_hashes = [f.identifier for f in new.mm_features]
            blocks = new.block_ids[0]
            if new.req_id in self._requests_need_load:
                meta.requests.append(
                    request_meta(handed_over(tokens), blocks, size, False, mm_hashes)
                )
            elif self._stores and tokens and not self._stored(tokens, mm_hashes):
                scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                if new.num_computed_tokens + scheduled < len(tokens):
                    logger.warning(
                        "%s: request %s's prompt (%d tokens) is computed in chunks; its KV "
                        "is not stored (the decode side computes it)",
                        CONNECTOR_NAME,
                        new.req_id,
                        len(tokens),
                    )
                    continue
                meta.requests.append(request_meta(tokens, blocks, size, True, mm_hashes))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A preempted request resumes with all of its blocks and loads its prompt again.
            request = self._requests_need_load.get(req_id)
            block_ids = cached.new_block_ids[i]
            if request is None or req_id not in cached.resumed_req_ids or block_ids is None:
                continue
            mm_hashes = [f.identifier for f in request.mm_features]
            handed = handed_over(request.prompt_token_ids or [])
            meta.requests.append(request_meta(handed, block_ids[0], size, False, mm_hashes))
        self._requests_need_load.clear()
        return meta
