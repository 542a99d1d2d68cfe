"""Two ranks on one device are refused at join, on every rank, naming both ranks.

The rendezvous is real (TCPStore over loopback, one thread per rank); the device
identities are what ``P2pNcclAFDConnector._device_identity`` reports on a GPU host
(host, CUDA index, name, UUID), written here by hand because this machine has no GPU.
tools/gpu_check.py ran the same refusal with the real connector on one H200.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from afd_connectors_gpu.rendezvous import check_distinct_devices, join_store
from afd_connectors_gpu.testing import free_port, rank_config
from afd_core.errors import AFDConfigError
from afd_core.topology import AFDTopology

GPU0 = "node-a cuda:0 (NVIDIA H200, GPU-0a1b)"
GPU1 = "node-a cuda:1 (NVIDIA H200, GPU-2c3d)"
GPU2 = "node-a cuda:2 (NVIDIA H200, GPU-4e5f)"


def _join_all(topology: AFDTopology, devices: list[str | None]) -> list[Any]:
    port = free_port()
    results: list[Any] = [None] * topology.world_size
    keep: list[Any] = []  # the stores stay open until every rank is done (attention
    # rank 0 hosts the server; the data plane's later barriers do this in a real join)

    def rank(g: int) -> None:
        try:
            config = rank_config(topology, g, port=port, connect_timeout_s=20.0)
            stores = join_store(
                config=config, global_rank=g, label=f"rank {g}", device_identity=devices[g]
            )
            keep.append(stores)
            results[g] = "joined"
        except Exception as exc:
            results[g] = exc

    threads = [threading.Thread(target=rank, args=(g,)) for g in range(topology.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    keep.clear()
    return results


def test_two_ranks_on_one_device_are_refused_on_every_rank() -> None:
    topo = AFDTopology(2, 1)  # global ranks: attention 0, attention 1, ffn 0
    results = _join_all(topo, [GPU0, GPU1, GPU0])
    for got in results:
        assert isinstance(got, AFDConfigError), results
        text = str(got)
        assert "attention rank 0 (global rank 0) and ffn rank 0 (global rank 2)" in text
        assert GPU0 in text and "CUDA_VISIBLE_DEVICES" in text


def test_distinct_devices_and_cpu_ranks_join() -> None:
    assert _join_all(AFDTopology(2, 1), [GPU0, GPU1, GPU2]) == ["joined"] * 3
    assert _join_all(AFDTopology(1, 1), [None, None]) == ["joined"] * 2


def test_the_check_names_the_first_owner_of_the_device() -> None:
    topo = AFDTopology(3, 2)
    with pytest.raises(AFDConfigError, match=r"attention rank 1 \(global rank 1\) and ffn rank 1"):
        check_distinct_devices(topo, ["a", "b", "c", "d", "b"])
    check_distinct_devices(topo, ["", "", "", "", ""])
