"""Admission at the rendezvous (afd_core.admission over a real TCPStore, one thread per
rank): tokens, taken ranks and deployment fingerprints.

A stranger (no token, a wrong token, a rank that is taken) is refused with a clear
error while the deployment keeps its store and its keys; two roles that loaded
different models are both stopped, with the differing fields named.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from afd_connectors_gpu.rendezvous import join_store
from afd_connectors_gpu.testing import free_port, rank_config
from afd_core.config import AFDConfig
from afd_core.errors import AFDAdmissionError, AFDFingerprintMismatchError
from afd_core.topology import AFDTopology

TOKEN = "token-of-the-legitimate-deployment"
IDENTITY = {"architecture": "AFDQwen3MoeForCausalLM", "dtype": "bfloat16", "checkpoint": "c0"}


def _config(port: int, g: int, topology: AFDTopology, **values: Any) -> AFDConfig:
    config: AFDConfig = rank_config(topology, g, port=port, connect_timeout_s=10.0, **values)
    return config


def _join(
    port: int,
    g: int,
    topology: AFDTopology,
    identity: Mapping[str, str] | None = IDENTITY,
    **values: Any,
) -> tuple[Any, ...]:
    return join_store(
        config=_config(port, g, topology, **values),
        global_rank=g,
        label=f"global rank {g}",
        identity=identity,
    )


def _join_all(
    port: int, topology: AFDTopology, per_rank: Mapping[int, dict[str, Any]]
) -> tuple[dict[int, Any], dict[int, float]]:
    """Join every rank in a thread; results (joined tuple or exception) and seconds taken."""
    results: dict[int, Any] = {}
    took: dict[int, float] = {}

    def run(g: int) -> None:
        t0 = time.monotonic()
        try:
            results[g] = _join(port, g, topology, **per_rank.get(g, {}))
        except Exception as exc:
            results[g] = exc
        took[g] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(g,)) for g in range(topology.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results, took


@contextmanager
def _deployment(topology: AFDTopology, **values: Any) -> Iterator[tuple[int, dict[int, Any]]]:
    port = free_port()
    per_rank = {g: dict(values) for g in range(topology.world_size)}
    results, _ = _join_all(port, topology, per_rank)
    assert all(isinstance(r, tuple) for r in results.values()), results
    try:
        yield port, results
    finally:
        for r in results.values():
            if r[3] is not None:
                r[3].stop()


def _session_keys_intact(results: dict[int, Any], topology: AFDTopology) -> None:
    for g, (_, session, _, _) in results.items():
        assert session.get(f"join/{g}") == b"", g
        session.set(f"after/{g}", "1")
    assert results[0][1].check([f"after/{g}" for g in range(topology.world_size)])


@pytest.mark.parametrize(
    ("rogue", "message"),
    [
        ({}, "requires a token and the process presented none"),
        ({"auth_token": "a-wrong-token-of-enough-chars"}, "wrong token"),
        ({"auth_token": TOKEN}, "ffn rank 0 is already connected"),
    ],
    ids=["no-token", "wrong-token", "rank-taken"],
)
def test_a_stranger_is_refused_and_the_deployment_keeps_its_keys(
    rogue: dict[str, Any], message: str
) -> None:
    topology = AFDTopology(1, 1)
    with _deployment(topology, auth_token=TOKEN) as (port, results):
        desk = results[0][3]
        assert desk is not None and desk.complete
        t0 = time.monotonic()
        with pytest.raises(AFDAdmissionError, match=message):
            _join(port, 1, topology, **rogue)
        assert time.monotonic() - t0 < 5.0
        assert desk.refused == 1
        _session_keys_intact(results, topology)


def test_an_open_deployment_refuses_a_joiner_with_a_token() -> None:
    topology = AFDTopology(1, 1)
    with (
        _deployment(topology) as (port, _),
        pytest.raises(AFDAdmissionError, match="started without one"),
    ):
        _join(port, 1, topology, auth_token=TOKEN)


def test_a_squatter_without_the_token_cannot_admit_anyone() -> None:
    """A process holding the port before attention rank 0 and admitting everyone (it
    follows the protocol's keys but has no token) is unmasked by the joining rank."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    squatter = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    squatter.set("afd-admit/mode", "open")
    squatter.set("afd-admit/nonce", "00")

    def admit_everyone() -> None:
        squatter.wait(["afd-admit/hello/1"], timedelta(seconds=10))
        squatter.set("afd-admit/verdict/1", '{"ok": true, "kind": "", "reason": ""}')

    thread = threading.Thread(target=admit_everyone)
    thread.start()
    with pytest.raises(AFDAdmissionError, match="without proving the deployment token"):
        _join(port, 1, AFDTopology(1, 1), auth_token=TOKEN)
    thread.join(timeout=10)


@pytest.mark.parametrize(
    ("ffn_identity", "fields"),
    [
        ({**IDENTITY, "dtype": "float32"}, ["dtype: attention rank 0 has 'bfloat16'"]),
        (
            {**IDENTITY, "architecture": "AFDDeepseekV3ForCausalLM", "checkpoint": "c1"},
            ["architecture:", "'AFDDeepseekV3ForCausalLM'", "checkpoint:"],
        ),
    ],
    ids=["dtype", "architecture"],
)
def test_a_fingerprint_mismatch_stops_both_roles(
    ffn_identity: dict[str, str], fields: list[str]
) -> None:
    topology = AFDTopology(2, 1)  # global ranks: attention 0, attention 1, ffn 0
    port = free_port()
    results, took = _join_all(port, topology, {2: {"identity": ffn_identity}})
    for g in (0, 2):
        assert isinstance(results[g], AFDFingerprintMismatchError), results
        for field in fields:
            assert field in str(results[g])
        assert "afd.fingerprint_allow" in str(results[g])
        assert took[g] < 10.0
    assert isinstance(results[1], Exception)  # the store is gone: nobody comes up


def test_allowed_differences_and_settings_mismatches() -> None:
    topology = AFDTopology(1, 1)
    port = free_port()
    other = {**IDENTITY, "dtype": "float32"}
    results, _ = _join_all(port, topology, {1: {"identity": other, "fingerprint_allow": ["dtype"]}})
    assert all(isinstance(r, tuple) for r in results.values()), results
    results[0][3].stop()
    # The gate placement is part of every fingerprint, model or not.
    results, _ = _join_all(free_port(), topology, {1: {"compute_gate_on_attention": True}})
    assert isinstance(results[1], AFDFingerprintMismatchError), results
    assert "gate_on_attention: attention rank 0 has 'ffn', ffn rank 0 has 'attention'" in str(
        results[1]
    )


@pytest.mark.parametrize(
    ("field", "ffn_value", "expected"),
    [
        (
            "transfer_dtype",
            "fp8",
            "transfer_dtype: attention rank 0 has 'model', ffn rank 0 has 'fp8'",
        ),
        (
            "transfer_dtype_return",
            "mxfp8",
            "transfer_dtype_return: attention rank 0 has 'model', ffn rank 0 has 'mxfp8'",
        ),
    ],
)
def test_a_transfer_dtype_mismatch_is_refused_at_join_naming_both_values(
    field: str, ffn_value: str, expected: str
) -> None:
    """Fingerprint drill (issue 44): an FFN rank started with another transfer dtype than
    the Attention role would dequantize bytes the other side never quantized; it is
    refused when it joins, the message naming the field and both values."""
    topology = AFDTopology(1, 1)
    results, took = _join_all(free_port(), topology, {1: {field: ffn_value}})
    for g in (0, 1):
        assert isinstance(results[g], AFDFingerprintMismatchError), results
        assert expected in str(results[g])
        assert took[g] < 10.0
    # The same values on both sides join.
    same = {g: {field: ffn_value} for g in (0, 1)}
    results, _ = _join_all(free_port(), topology, same)
    assert all(isinstance(r, tuple) for r in results.values()), results
    results[0][3].stop()


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.append(address)
    return found


def test_the_rendezvous_listens_on_the_configured_host_only() -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp")
    with _deployment(AFDTopology(1, 1)) as (port, _):
        assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 / ::


def test_an_attention_tp_size_the_ffn_side_was_not_started_for_is_refused() -> None:
    # Attention ranks of TP size 2 (their engines' size); the FFN rank was started for
    # afd.attention_tensor_parallel_size=1 (afd_moe_runners.identity puts both in the
    # fingerprint's attention_tp field).
    topology = AFDTopology(1, 1)
    port = free_port()
    tp2, tp1 = {**IDENTITY, "attention_tp": "2"}, {**IDENTITY, "attention_tp": "1"}
    results, took = _join_all(port, topology, {0: {"identity": tp2}, 1: {"identity": tp1}})
    for g in (0, 1):
        assert isinstance(results[g], AFDFingerprintMismatchError), results
        message = str(results[g])
        assert "attention_tp: attention rank 0 has '2', ffn rank 0 has '1'" in message
        assert len(message.splitlines()) == 1
        assert took[g] < 10.0


def test_two_processes_claiming_one_rank_while_assembling_stop_the_host() -> None:
    """Two FFN processes started with the same afd.rank (one expert shard) while the
    deployment assembles: the second is refused, and the host stops at once with one
    error naming the rank, the shard and both claimants, instead of waiting out
    afd.connect_timeout_s for the rank nobody started."""
    topology = AFDTopology(2, 1)  # global ranks: attention 0, attention 1, ffn 0
    port = free_port()
    # Expert plane 0 of FFN EP2 (afd_moe_runners.expert_parallel): its attention ranks
    # carry the shard they talk to in their fingerprint too.
    ffn_identity = {**IDENTITY, "expert_shard": "0/2"}
    results: dict[str, Any] = {}
    took: dict[str, float] = {}

    def run(name: str, g: int, identity: Mapping[str, str]) -> None:
        t0 = time.monotonic()
        try:
            results[name] = _join(port, g, topology, identity=identity)
        except Exception as exc:
            results[name] = exc
        took[name] = time.monotonic() - t0

    # Attention rank 1 never comes: the deployment is still assembling when the second
    # FFN process says hello.
    host = threading.Thread(target=run, args=("host", 0, ffn_identity))  # plane 0's host
    host.start()
    first = threading.Thread(target=run, args=("first", 2, ffn_identity))
    first.start()
    # The first claimant is admitted (its verdict written; it then waits for attention
    # rank 1) before the second one says hello.
    from datetime import timedelta

    from torch.distributed import TCPStore

    watcher = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=10), wait_for_workers=False)
    watcher.wait(["afd-admit/verdict/1"], timedelta(seconds=10))
    assert b'"ok": true' in watcher.get("afd-admit/verdict/1")
    second = threading.Thread(target=run, args=("second", 2, ffn_identity))
    second.start()
    for t in (host, first, second):
        t.join(timeout=30)
    assert isinstance(results["second"], AFDAdmissionError), results
    assert "ffn rank 0 is already connected" in str(results["second"])
    host_error = results["host"]
    assert isinstance(host_error, AFDAdmissionError), results
    text = str(host_error)
    for part in ("ffn rank 0 is already connected", "expert shard 0/2", "a second process"):
        assert part in text, text
    assert "afd.rank (0..1)" in text, text  # the EP size, from the shard
    assert text.count(" pid ") == 2, text  # both claimants named
    assert took["host"] < 10.0, took
    # The admitted one fails too once the host is gone (here a thread of this process:
    # the host's store lives until collected, so no time bound is asserted for it).
    assert isinstance(results["first"], Exception), results


def test_a_shard_claimed_twice_at_one_expert_plane_stops_the_plane_still_waiting() -> None:
    """FFN EP2: attention rank 0 hosts one rendezvous per expert plane (port + f), one after
    another, inside ``assembling()``. Two FFN processes both started as rank 0 meet at
    plane 0, which is complete once the first is admitted; the second is refused there,
    and plane 1 (waiting for the FFN rank 1 nobody started) stops at once with that error
    instead of waiting out afd.connect_timeout_s."""
    from afd_core.admission import assembling

    topology = AFDTopology(1, 1)  # each plane: attention 0, ffn 0
    base = free_port()
    plane_ports = [base, free_port()]
    results: dict[str, Any] = {}
    took: dict[str, float] = {}

    def host() -> None:
        t0 = time.monotonic()
        joined = []
        try:
            with assembling():
                for f, port in enumerate(plane_ports):
                    identity = {**IDENTITY, "expert_shard": f"{f}/2"}
                    joined.append(_join(port, 0, topology, identity=identity))
            results["host"] = joined
        except Exception as exc:
            results["host"] = exc
        finally:
            for j in joined:
                j[3].stop()
        took["host"] = time.monotonic() - t0

    def ffn(name: str) -> None:
        try:
            shard0 = {**IDENTITY, "expert_shard": "0/2"}
            results[name] = _join(plane_ports[0], 1, topology, identity=shard0)
        except Exception as exc:
            results[name] = exc

    threads = [threading.Thread(target=host), threading.Thread(target=ffn, args=("first",))]
    for t in threads:
        t.start()
    from datetime import timedelta

    from torch.distributed import TCPStore

    watcher = TCPStore(
        "127.0.0.1", plane_ports[0], 1, False, timedelta(seconds=10), wait_for_workers=False
    )
    watcher.wait(["afd-admit/verdict/1"], timedelta(seconds=10))
    second = threading.Thread(target=ffn, args=("second",))
    second.start()
    for t in (*threads, second):
        t.join(timeout=30)
    assert isinstance(results["second"], AFDAdmissionError), results
    error = results["host"]
    assert isinstance(error, AFDAdmissionError), results
    text = str(error)
    assert "ffn rank 0 is already connected" in text and "expert shard 0/2" in text, text
    assert "afd.rank (0..1)" in text, text
    assert took["host"] < 10.0, took  # afd.connect_timeout_s is 10 here
