"""Parallel roles end to end (``afd launch``, float32, served one request at a time,
greedy tokens of 10 prompts x 16 equal to native vLLM asked the same way):

* Attention TP2 + 1 FFN (``attention_tensor_parallel_size = 2``: TP worker 0 exchanges
  and broadcasts each answer, afd_moe_runners.tensor_parallel), reference native TP=2;
  the FFN rank sees one peer and receives exactly what the attention rank sent once.
* FFN EP2 (``ffn_expert_parallel = true``: each FFN rank holds half the routed experts,
  afd_moe_runners.expert_parallel) with Attention TP1, TP2 and 2 DP ranks; reference
  native at the attention TP size; each FFN rank's log says it allocated only its share
  (read from its expert tensors). Dispatch proof, row by row: the attention ranks record
  every send (``AFD_RECORD_DISPATCH``: the gate's top-k of each row, the rows each FFN
  rank got); each FFN rank got exactly the rows routed to its shard (every row with the
  gate on FFN) and served (``afd_ffn_tokens_served_total``) as many; eager, gate on
  Attention, one attention rank: the recorded top-k is native vLLM's own routing of the
  same tokens row for row (``afd.reference --record-routing``), and the counts equal it.
* DeepSeek-V3-style (grouped top-k, shared expert, dense first layer) TP1 + EP2.

Both gate placements where listed. Where they run (CI's budget: a parallel layout is
2-5 vLLM processes on a 2-core host, 130-290 s a case; all seven took 16.5 min of a
2-worker run on 2026-12-02): CI (``matrix``, ``nox -s tests-matrix``) runs FFN EP2 with
the gate on Attention eager (the dispatch against native routing), Attention TP2 + FFN EP2
with the gate on Attention compiled (the TP exchange and the M2N dispatch at once; its
eager twin ``extended`` since 2026-12-04, CI measured 41.9 min) and DeepSeek-V3 EP2 with
the gate on FFN compiled (the replicated router, a shared expert, a dense layer); the
other layouts and the bfloat16 load test are ``extended`` (``nox -s
tests-extended``, by hand: run them when the parallel code changes). The default run has
the TP and EP exchanges' unit tests (packages/afd-moe-runners/tests/test_tensor_parallel.py,
test_expert_parallel.py, test_expert_shard.py). The deployments run eager
(``enforce_eager = true``) against eager native references, except the ``-compiled``
cases: deployment and native reference in vLLM's default compile mode, every step of
every attention rank proving it ran each layer's exchange through the compiled op
(``afd_attention_compiled_exchanges_total`` == ``afd_attention_steps_total`` x layers),
and every TP worker logging the op's first call. Attention TP2
+ FFN EP2 compiled (gate on Attention) and DeepSeek-V3 EP2 compiled (gate on FFN; its
eager twin is ``extended``) run in CI (``matrix``, ~3 min each). Compiled, native vLLM's
routing cannot be recorded, so the dispatch proof is the eager cases'.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_processes import Launcher, assert_same_tokens, metric_samples, settled_metric_samples
from afd_references import singles

from afd.tools.client import complete
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

STARTUP_S = 420.0
PROMPTS = list(FIXED_PROMPTS[:10])
MAX_TOKENS = 16


def _complete(url: str, prompt: str) -> list[int]:
    return complete(url, prompt, MAX_TOKENS, timeout=300).token_ids


MATRIX = pytest.mark.matrix
EXTENDED = pytest.mark.extended
COMPILED = pytest.mark.compiled


def _case(
    tp: int,
    dp: int,
    ep: int,
    gate: str,
    *marks: Any,
    family: str = "qwen3_moe",
    compiled: bool = False,
) -> Any:
    name = f"tp{tp}-dp{dp}-ep{ep}-{gate}"
    if family != "qwen3_moe":
        name = f"{family}-{name}"
    if compiled:
        name += "-compiled"
    return pytest.param(family, tp, dp, ep, gate, compiled, marks=marks, id=name)


def _moe_shape(model: Path) -> tuple[int, int]:
    """(MoE layers, routed experts per layer) of a tiny checkpoint."""
    config = json.loads((model / "config.json").read_text())
    names = ("n_routed_experts", "num_experts", "num_local_experts")
    experts = next(config[n] for n in names if config.get(n))
    dense = config.get("first_k_dense_replace", 0) + len(config.get("mlp_only_layers", []))
    return config["num_hidden_layers"] - dense, experts


def _dispatch_records(folder: Path) -> dict[Path, list[dict[str, Any]]]:
    """What each attention rank's exchange recorded (``AFD_RECORD_DISPATCH``,
    afd_moe_runners.expert_parallel.DispatchRecorder): file -> one record per send."""
    return {
        path: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(folder.glob("attention*.jsonl"))
    }


def _dispatch_problems(
    records: list[dict[str, Any]], experts: int, ep: int, shared: bool, gate_on_ffn: bool
) -> list[str]:
    """Where a recorded send did not give FFN rank f exactly the rows the gate's top-k ids
    route to its shard (computed here with sets): a top-k row goes to f when one of its
    experts is in ``expert_shard(experts, ep, f)`` (FFN rank 0: every row with shared
    experts); a layer without top-k (dense) goes to FFN rank 0 alone; with the gate on
    FFN every row goes to every FFN rank (``null``)."""
    from afd_core.topology import expert_shard

    shards = [set(expert_shard(experts, ep, f)) for f in range(ep)]
    problems = []
    for n, rec in enumerate(records):
        rows = list(range(rec["rows"]))
        if gate_on_ffn:
            want: list[list[int] | None] = [None] * ep
        elif rec["topk"] is None:
            want = [None, *([[]] * (ep - 1))]
        else:
            assert len(rec["topk"]) == rec["rows"]
            want = [
                rows if f == 0 and shared
                else [t for t, ids in enumerate(rec["topk"]) if shards[f] & set(ids)]
                for f in range(ep)
            ]  # fmt: skip
        if rec["planes"] != want:
            problems.append(f"send {n} (layer {rec['layer']}): sent {rec['planes']}, routed {want}")
    return problems


def _tokens_served(url: str, rank: int) -> int:
    return int(
        settled_metric_samples(f"{url}/metrics")[
            ("afd_ffn_tokens_served_total", (("rank", str(rank)),))
        ]
    )


def _dispatched(model: Path, routing: list[dict[str, list[list[int]]]], ep: int) -> list[int]:
    """Tokens each FFN rank must receive with the gate on Attention, from native vLLM's
    routing (per group: MoE layer -> top-k ids of each token row): a row goes to FFN rank
    f when one of its experts is in f's shard; FFN rank 0 also gets every row of every
    layer when the model has shared experts, and every row of the dense layers."""
    from afd_core.topology import expert_shard

    config = json.loads((model / "config.json").read_text())
    layers, experts = _moe_shape(model)
    dense = config["num_hidden_layers"] - layers
    shared = bool(config.get("n_shared_experts") or config.get("shared_expert_intermediate_size"))
    counts = [0] * ep
    for group in routing:
        assert len(group) == layers, sorted(group)
        rows = {len(r) for r in group.values()}
        assert len(rows) == 1, rows  # every MoE layer computed every token of the group
        counts[0] += dense * rows.pop()
        for f in range(ep):
            shard = expert_shard(experts, ep, f)
            for layer_rows in group.values():
                if f == 0 and shared:
                    counts[0] += len(layer_rows)
                else:
                    counts[f] += sum(any(e in shard for e in ids) for ids in layer_rows)
    return counts


# Three cases in `nox -s tests-matrix` (CI; the two compiled ones also in `tests-compiled`),
# the rest `extended` (see the module docstring).
@pytest.mark.timeout(900)  # a TP=2 native reference and TP workers start slowly on 2 cores
@pytest.mark.parametrize(
    ("family", "tp", "dp", "ep", "gate", "compiled"),
    [
        _case(2, 1, 1, "attention-topk", EXTENDED),
        _case(2, 1, 1, "ffn", EXTENDED),
        # Eager EP2 with the gate on Attention: the dispatch checked against native
        # vLLM's routing row by row (CI). Attention TP2 + EP2 eager is `extended` since
        # 2026-12-04 (CI measured 41.9 min): its compiled twin below runs the same layout.
        _case(1, 1, 2, "attention-topk", MATRIX),
        _case(1, 1, 2, "ffn", EXTENDED),
        _case(2, 1, 2, "attention-topk", EXTENDED),
        _case(1, 2, 2, "attention-topk", EXTENDED),
        # DeepSeek-V3-style: grouped top-k, a shared expert (FFN rank 0 gets every
        # token), a dense first layer (FFN rank 0 alone).
        _case(1, 1, 2, "attention-topk", EXTENDED, family="deepseek_v3"),
        # MLA under TP: native TP=2 gives other tokens than TP=1 on this build
        # (VLLM_CPU_FACTS.md), so Attention TP2 is compared with native TP=2.
        _case(2, 1, 1, "attention-topk", EXTENDED, family="deepseek_v3"),
        # Eager, the same layout as the compiled case below (CI runs that one: the
        # launcher's default mode, the same FFN side).
        _case(1, 1, 2, "ffn", EXTENDED, family="deepseek_v3"),
        # vLLM's default compile mode on both sides (the launcher's default).
        _case(2, 1, 2, "attention-topk", MATRIX, COMPILED, compiled=True),
        _case(1, 1, 2, "ffn", MATRIX, COMPILED, family="deepseek_v3", compiled=True),
    ],
)
def test_parallel_layout_served_tokens_equal_native(
    family: str,
    tp: int,
    dp: int,
    ep: int,
    gate: str,
    compiled: bool,
    tiny_model_of: Callable[[str], Path],
    native_references: Any,
    tmp_path: Path,
) -> None:
    model = tiny_model_of(family)
    # The reference: native vLLM at the attention TP size (Qwen3-MoE float32 gives the
    # same tokens at TP=1 and TP=2 natively; each is compared with its own). With the
    # gate on Attention under expert parallelism and one attention rank, the reference
    # also records its routing: the dispatch each FFN rank must have received.
    # Compiled: both sides in vLLM's default compile mode (the deployment's default).
    ref_kwargs: dict[str, Any] = {"tensor_parallel_size": tp} if tp > 1 else {}
    if compiled:
        ref_kwargs["enforce_eager"] = False
    # (Native routing is recorded in eager mode only: compiled, the router runs inside
    # the graph; the eager case of the same layout proves the dispatch.)
    dispatch_proof = ep > 1 and gate != "ffn" and dp == 1 and not compiled
    routing: list[dict[str, list[list[int]]]] = []
    if dispatch_proof:
        groups, routing = native_references.routed(
            model, singles(PROMPTS), dtype="float32", max_tokens=MAX_TOKENS,
            llm_kwargs=ref_kwargs,
        )  # fmt: skip
    else:
        groups = native_references.groups(
            model, singles(PROMPTS), dtype="float32", max_tokens=MAX_TOKENS,
            llm_kwargs=ref_kwargs,
        )  # fmt: skip
    native = [g[0] for g in groups]
    spec = tmp_path / "layout.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = {dp}\nnum_ffn = {ep}\n'
        f"attention_tensor_parallel_size = {tp}\n"
        f"ffn_expert_parallel = {'true' if ep > 1 else 'false'}\n"
        f'dtype = "float32"\nlog_dir = "{tmp_path / "logs"}"\n'
        f"enforce_eager = {'false' if compiled else 'true'}\n"
        f"compute_gate_on_attention = {'true' if gate != 'ffn' else 'false'}\n"
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
    )
    # Under expert parallelism each attention rank's exchange records its dispatch: per
    # send, the gate's top-k ids of every row and the rows each FFN rank got.
    recorded = tmp_path / "dispatch"
    env = {"AFD_RECORD_DISPATCH": str(recorded)} if ep > 1 else {}
    launcher = Launcher(spec, tmp_path, env=env)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up:\n{launcher.output[-6000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)[0]
        ffn_urls = dict(
            (name, u)
            for u, name in re.findall(
                r"^\[afd\]\s+(http://[\d.]+:\d+)/health, \S+/metrics  \((ffn\d)\)",
                launcher.output,
                re.M,
            )
        )
        assert sorted(ffn_urls) == [f"ffn{f}" for f in range(ep)], launcher.output[-3000:]
        before = [_tokens_served(ffn_urls[f"ffn{f}"], f) for f in range(ep)]
        records_before = {p: len(r) for p, r in _dispatch_records(recorded).items()}
        got = [_complete(url, p) for p in PROMPTS]
        what = f"native vLLM TP={tp}{' compiled' if compiled else ''}, one request at a time"
        assert_same_tokens(got, native, PROMPTS, what, max_tokens=MAX_TOKENS)
        if compiled:
            from afd_moe_runners.exchange_op import COMPILED_LOG

            # Every step of every attention rank ran each layer's exchange through the
            # compiled op (afd_attention_compiled_exchanges_total, counted by TP worker
            # 0 as the other exchange metrics; one micro-batch per step), every layer
            # exchanging (the dense ones through the dense stand-in).
            layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
            counted = settled_metric_samples(f"{url}/metrics")
            for a in range(dp):
                rank = (("rank", str(a)),)
                steps = counted[("afd_attention_steps_total", rank)]
                assert steps >= len(PROMPTS) * MAX_TOKENS, (a, steps)
                compiled_exchanges = counted[("afd_attention_compiled_exchanges_total", rank)]
                assert compiled_exchanges == steps * layers, (a, steps, layers, compiled_exchanges)
            # The TP workers past 0 (not counted in the metrics) ran the compiled graph
            # too: each logs the op's first call.
            log = (tmp_path / "logs" / "attn.log").read_text()
            assert log.count(COMPILED_LOG) == dp * tp, log[-3000:]
        attn = metric_samples(f"{url}/metrics")
        ffn = {f: settled_metric_samples(f"{ffn_urls[f'ffn{f}']}/metrics") for f in range(ep)}
        for f in range(ep):
            rank = (("rank", str(f)),)
            # Every attention (DP) rank is a peer of every FFN rank; a TP group is one.
            assert ffn[f][("afd_ffn_peers_connected", rank)] == dp
            assert ffn[f][("afd_ffn_tokens_served_total", rank)] > 0
        if ep == 1:
            # Counted once, by TP worker 0: what the attention ranks sent is what the FFN
            # rank received (a second sender would leave them unequal).
            sent = sum(attn[("afd_attention_sent_bytes_total", (("rank", str(a)),))]
                       for a in range(dp))  # fmt: skip
            assert sent > 0
            assert sent == ffn[0][("afd_ffn_received_bytes_total", (("rank", "0"),))]
        else:
            # Each FFN rank allocated only its share of the routed experts (counted from
            # its MoE layers' expert tensors, afd_moe_runners.expert_shard).
            from afd_core.topology import expert_shard

            layers, experts = _moe_shape(model)
            out = launcher.output
            # Row by row: the sends of the served requests (after start-up's), each FFN
            # rank's rows exactly those routed to its shard by the recorded top-k, and
            # each FFN rank served (its own metric) the rows it was sent.
            files = {
                path: recs[records_before.get(path, 0) :]
                for path, recs in _dispatch_records(recorded).items()
            }
            sends = [r for recs in files.values() for r in recs]
            assert sends, f"nothing recorded in {recorded}: {sorted(files)}"
            config = json.loads((model / "config.json").read_text())
            shared = bool(
                config.get("n_shared_experts") or config.get("shared_expert_intermediate_size")
            )
            problems = _dispatch_problems(sends, experts, ep, shared, gate == "ffn")
            assert not problems, "\n".join(problems[:10])
            served_now = [_tokens_served(ffn_urls[f"ffn{f}"], f) - before[f] for f in range(ep)]
            sent = [
                sum(r["rows"] if r["planes"][f] is None else len(r["planes"][f]) for r in sends)
                for f in range(ep)
            ]
            assert served_now == sent, (served_now, sent)
            if gate != "ffn":
                assert min(sent) < sum(r["rows"] for r in sends), sent  # a real split
            if dispatch_proof:
                # The recorded top-k is native vLLM's routing of the same tokens, row by
                # row per MoE layer (one attention rank, requests one at a time).
                assert len([recs for recs in files.values() if recs]) == 1, sorted(files)
                afd_rows: dict[int, list[list[int]]] = {}
                for r in sends:
                    if r["topk"] is not None:
                        afd_rows.setdefault(r["layer"], []).extend(sorted(i) for i in r["topk"])
                native_rows: dict[int, list[list[int]]] = {}
                for group in routing:
                    for layer, rows in group.items():
                        native_rows.setdefault(int(layer), []).extend(sorted(i) for i in rows)
                assert sorted(afd_rows) == sorted(native_rows), (
                    sorted(afd_rows), sorted(native_rows)
                )  # fmt: skip
                for layer, rows in native_rows.items():
                    assert afd_rows[layer] == rows, f"layer {layer}: the gate routed otherwise"
                # Each FFN rank received exactly the tokens routed to its experts (FFN
                # rank 0 every token, where the model has shared experts or dense layers).
                expected = _dispatched(model, routing, ep)
                served = [_tokens_served(ffn_urls[f"ffn{f}"], f) - before[f] for f in range(ep)]
                assert served == expected, (served, expected)
                assert min(served) < sum(len(r) for g in routing for r in g.values())
            for f in range(ep):
                held = layers * len(expert_shard(experts, ep, f))
                assert re.search(
                    rf"\[ffn{f}\].*AFD FFN rank {f} of {ep} \(expert parallel\): "
                    rf"routed_experts_held={held} routed_experts_absent={layers * experts - held}",
                    out,
                ), out[-3000:]
    finally:
        launcher.kill_all()


@pytest.mark.timeout(900)
@pytest.mark.extended  # `nox -s tests-extended` (see the module docstring)
def test_tp2_ep2_bf16_serves_32_concurrent_requests_in_full(
    tiny_qwen_models: dict[str | None, Path], tmp_path: Path
) -> None:
    """bfloat16, Attention TP2 + FFN EP2, gate on Attention: 32 requests at once, every
    answer full length (tokens are not compared: bf16 sums in another order)."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_qwen_models[None]
    spec = tmp_path / "bf16.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = 1\nnum_ffn = 2\n'
        "attention_tensor_parallel_size = 2\nffn_expert_parallel = true\n"
        f'dtype = "bfloat16"\nlog_dir = "{tmp_path / "logs"}"\nenforce_eager = true\n'
        'compute_gate_on_attention = true\nvllm_args = ["--max-num-seqs", "32"]\n'
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
    )
    launcher = Launcher(spec, tmp_path)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up:\n{launcher.output[-6000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)[0]
        prompts = [FIXED_PROMPTS[i % len(FIXED_PROMPTS)] for i in range(32)]
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda p: _complete(url, p), prompts))
        assert [len(a) for a in answers] == [MAX_TOKENS] * 32
    finally:
        launcher.kill_all()
