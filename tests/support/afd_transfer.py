"""Accuracy of a low-precision transfer dtype against native vLLM (issue 44): greedy
tokens and the chosen tokens' logprobs (vLLM's ``logprobs``) of served completions.

Used by tests/e2e/test_transfer_dtype.py (bounded) and tools/transfer_accuracy.py (the
table in docs/performance.md). The comparison:

* ``identical``: prompts whose whole completion equals native vLLM's;
* ``token_agreement``: positions equal to native vLLM's up to each prompt's first
  difference, over all positions (after a difference the contexts differ, and so would
  every later token's logprob);
* ``logprob_gap``: mean ``|logprob_afd - logprob_native|`` of the chosen token, over the
  positions of that common prefix (where both sides chose the same token in the same
  context).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from afd_processes import FFNServer, Server, afd_settings, stop_cleanly, stop_roles

from afd.tools.client import post_json, served_model

#: Completions of the comparison: 10 prompts x 64 tokens.
MAX_TOKENS = 64


@dataclass(frozen=True)
class Greedy:
    """One server's greedy completions: token ids and the chosen tokens' logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


@dataclass(frozen=True)
class Agreement:
    prompts: int
    identical: int
    token_agreement: float
    logprob_gap: float
    """Mean |logprob difference| over the common prefixes (nats)."""
    logprob_gap_max: float
    positions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def greedy_with_logprobs(url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> Greedy:
    """Greedy completions, one request per prompt (identical batches on both servers),
    with the logprob of each chosen token."""
    model = served_model(url)
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for prompt in prompts:
        payload = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_token_ids": True,
        }
        choice = post_json(f"{url}/v1/completions", payload, 300)["choices"][0]
        tokens.append(list(choice["token_ids"]))
        logprobs.append([float(x) for x in choice["logprobs"]["token_logprobs"]])
        assert len(tokens[-1]) == max_tokens == len(logprobs[-1]), choice
    return Greedy(tokens, logprobs)


def compare(native: Greedy, afd: Greedy) -> Agreement:
    agree = positions = identical = 0
    gaps: list[float] = []
    for n_tok, a_tok, n_lp, a_lp in zip(
        native.tokens, afd.tokens, native.logprobs, afd.logprobs, strict=True
    ):
        positions += len(n_tok)
        prefix = 0
        while prefix < len(n_tok) and n_tok[prefix] == a_tok[prefix]:
            gaps.append(abs(n_lp[prefix] - a_lp[prefix]))
            prefix += 1
        agree += prefix
        identical += prefix == len(n_tok)
    return Agreement(
        prompts=len(native.tokens),
        identical=identical,
        token_agreement=agree / positions,
        logprob_gap=sum(gaps) / len(gaps) if gaps else float("nan"),
        logprob_gap_max=max(gaps, default=float("nan")),
        positions=positions,
    )


def served_native(model: Path, tmp: Path, prompts: list[str], *args: str) -> Greedy:
    server = Server.native(model, tmp, *args)
    try:
        server.wait_ready()
        return greedy_with_logprobs(server.url, prompts)
    finally:
        stop_roles([server], grace_s=10)
        server.kill()


def served_afd(
    model: Path, tmp: Path, prompts: list[str], transfer: str, back: str, *args: str
) -> tuple[Greedy, str]:
    """1A1F (gate on FFN, afd serve's default connector) with ``transfer`` Attention ->
    FFN and ``back`` FFN -> Attention; every prompt served in full. Returns the
    completions and the FFN role's log."""
    afd = afd_settings("ffn", transfer_dtype=transfer, transfer_dtype_return=back)
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp, *args)
    attention = Server.afd_attention(model, {**afd, "role": "attention"}, tmp, *args)
    try:
        ffn.wait_ready()
        attention.wait_ready()
        got = greedy_with_logprobs(attention.url, prompts)
        stop_cleanly(attention, ffn)
    finally:
        attention.kill()
        ffn.kill()
    return got, ffn.output
