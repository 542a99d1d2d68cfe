"""The run's native reference cache (tests/support/afd_references.py) answers from disk
only for exactly the reference asked for: other weights under the same config, another
dtype, other prompts or grouping, another engine mode each miss.

The engine is replaced here by a recording stand-in (``Recorder``) so that a miss is seen
as a call and costs no vLLM start; every parity test uses the real one
(``run_native_groups``: ``python -m afd.reference --groups-file``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from afd_references import NativeReferences, batch, checkpoint_digest, reference_key, singles

PROMPTS = ("The capital of France is", "def add(a, b):", "1 2 3 4 5 6")


class Recorder:
    """Stands in for the native engine: records each call, answers distinct tokens."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, ...]], str, dict[str, Any]]] = []

    def __call__(
        self, model: Path, groups: list[Any], dtype: str, max_tokens: int, kw: dict[str, Any]
    ) -> list[list[list[int]]]:
        self.calls.append((model.name, [tuple(g) for g in groups], dtype, kw))
        n = len(self.calls)
        return [[[n * 1000 + i] * max_tokens for i, _ in enumerate(g)] for g in groups]


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """deepseek_v3 with seeds 0 and 1: same config, names and shapes, other weights
    (generated here side by side, so they are generated alike)."""
    from afd.tools.models.tiny import generate_tiny_checkpoint

    root = tmp_path_factory.mktemp("ref-seeds")
    return (
        generate_tiny_checkpoint("deepseek_v3", root / "deepseek_v3-s0", seed=0),
        generate_tiny_checkpoint("deepseek_v3", root / "deepseek_v3-s1", seed=1),
    )


def test_the_key_follows_the_weights_not_the_path_or_the_config(
    two_seeds: tuple[Path, Path], tmp_path: Path
) -> None:
    model, other_weights = two_seeds
    same_config = json.loads((other_weights / "config.json").read_text())
    assert same_config == json.loads((model / "config.json").read_text())
    assert checkpoint_digest(model) != checkpoint_digest(other_weights)
    assert reference_key(model, PROMPTS) != reference_key(other_weights, PROMPTS)
    copy = shutil.copytree(model, tmp_path / "elsewhere")
    assert reference_key(copy, PROMPTS) == reference_key(model, PROMPTS)


def test_the_key_follows_dtype_prompts_tokens_and_engine_mode(
    two_seeds: tuple[Path, Path],
) -> None:
    model = two_seeds[0]
    base = reference_key(model, PROMPTS)
    assert reference_key(model, PROMPTS, dtype="bfloat16") == base
    others = {
        reference_key(model, PROMPTS, dtype="float32"),
        reference_key(model, PROMPTS[:2]),
        reference_key(model, PROMPTS[::-1]),
        reference_key(model, PROMPTS, max_tokens=16),
        reference_key(model, PROMPTS, llm_kwargs={"enforce_eager": False}),
    }
    assert base not in others and len(others) == 5
    assert reference_key(model, PROMPTS, llm_kwargs={"enforce_eager": True}) == base


def test_hits_come_from_disk_and_misses_start_one_engine(
    two_seeds: tuple[Path, Path], tmp_path: Path
) -> None:
    model, other_weights = two_seeds
    engine = Recorder()
    refs = NativeReferences(tmp_path / "refs", runner=engine)

    first = refs.tokens(model, batch(PROMPTS))
    assert len(engine.calls) == 1 and first == refs.tokens(model, batch(PROMPTS))
    assert len(engine.calls) == 1, "the same reference was computed twice"
    # A new cache object on the same folder (the next nox session) hits too.
    again = NativeReferences(tmp_path / "refs", runner=engine)
    assert again.tokens(model, batch(PROMPTS)) == first and len(engine.calls) == 1

    # Other weights, same config: a miss.
    refs.tokens(other_weights, batch(PROMPTS))
    assert len(engine.calls) == 2 and engine.calls[-1][0] == other_weights.name
    # Another dtype: a miss.
    refs.tokens(model, batch(PROMPTS), dtype="float32")
    assert len(engine.calls) == 3 and engine.calls[-1][2] == "float32"
    # Several missing groups: one engine for all of them, only the missing ones.
    batched, served = refs.served_and_batched(model, PROMPTS, PROMPTS)
    assert batched == first
    assert len(engine.calls) == 4 and engine.calls[-1][1] == singles(PROMPTS)
    assert served == [ids for group in refs.groups(model, singles(PROMPTS)) for ids in group]
    assert len(engine.calls) == 4


def test_two_askers_at_once_start_one_engine(two_seeds: tuple[Path, Path], tmp_path: Path) -> None:
    """Two test processes (xdist workers) that miss the same reference at the same time:
    the second waits for the first's engine and reads its answer."""
    import threading
    import time

    model = two_seeds[0]
    recorder = Recorder()

    def slow_engine(*args: Any) -> list[list[list[int]]]:
        time.sleep(1.0)
        return recorder(*args)

    answers: list[list[list[int]]] = []
    askers = [
        threading.Thread(
            target=lambda: answers.append(
                NativeReferences(tmp_path / "refs", runner=slow_engine).tokens(
                    model, batch(PROMPTS)
                )
            )
        )
        for _ in range(2)
    ]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(timeout=30)
    assert len(answers) == 2 and answers[0] == answers[1]
    assert len(recorder.calls) == 1, "two engines computed the same reference"
