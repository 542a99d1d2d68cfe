"""The FFN role: a headless server built on vLLM's own executor and workers.

No scheduler, KV cache, sampler or HTTP API: :func:`run_ffn_server` builds the
engine configuration from ordinary vLLM engine arguments, lets vLLM's executor
create its worker(s) and load the model (the AFD wrapper, FFN role: FFN-owned
weights only), then asks each worker — through ``worker_extension_cls`` and
``collective_rpc`` — to serve ``receive -> compute layer -> send`` until the
Attention peers go away or the server is told to stop (SIGTERM / SIGINT).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from afd_core.config import AFDConfig, AFDRole, afd_config_of
from afd_core.errors import AFDConnectorClosedError, AFDPeerLostError

logger = logging.getLogger("afd.runtime.ffn_server")

READY_MARKER = "AFD FFN server ready"


def _afd_config(vllm_config: Any) -> AFDConfig:
    """The engine's AFD settings (parsed once per process, :func:`afd_config_of`)."""
    afd = afd_config_of(vllm_config)
    if afd is None:
        return AFDConfig.from_additional_config(vllm_config.additional_config)  # the error
    return afd


@dataclass
class ServeStats:
    layers_served: int = 0
    tokens_served: int = 0
    exit_reason: str = ""
    peer_lost: bool = False
    """The attention peers vanished (exited or crashed) without closing on purpose."""


class AFDWorkerExtension:
    """Mixed into vLLM's worker class (``parallel_config.worker_extension_cls``).

    ``afd_inventory`` / ``afd_parameter_names`` / ``afd_weight_owners`` report what the
    loaded role model owns (any role); ``afd_serve`` / ``afd_stop`` run the FFN role's
    serving loop.
    """

    def _afd_model(self) -> Any:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if not hasattr(model, "afd_ffn_blocks"):
            raise TypeError(
                f"{type(model).__name__} is not an AFD role-aware model (no afd_ffn_blocks); "
                "select the AFD architecture with hf_overrides"
            )
        return model

    def afd_inventory(self) -> dict[str, int]:
        """Parameter inventory of the loaded role model (tensors per category)."""
        return dict(self._afd_model().afd_runtime.inventory)

    def afd_parameter_names(self) -> list[str]:
        return [name for name, _ in self._afd_model().named_parameters()]

    def afd_weight_owners(self) -> dict[str, dict[str, int]]:
        """Checkpoint tensors this role loaded (``kept``) and left to the other role
        (``dropped``), by owner (``attention`` / ``ffn`` / ``both`` / ``none``)."""
        stats = self._afd_model().afd_runtime.weight_stats
        return {
            "kept": {o.value: n for o, n in stats.kept.items()},
            "dropped": {o.value: n for o, n in stats.dropped.items()},
        }

    def afd_serve(self) -> dict[str, Any]:
        """Serve layers until the peers leave or :meth:`afd_stop` is called."""
        from vllm.config import set_current_vllm_config

        from afd.runtime.environment import request_amx_tiles
        from afd_core.registry import create_connector
        from afd_moe_runners.builder import ffn_external_routing, shared_experts_on_attention
        from afd_moe_runners.ffn_compute import FFNLayerCompute
        from afd_moe_runners.metrics import ffn_metrics
        from afd_moe_runners.role_model import role_identity

        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        afd = _afd_config(vllm_config)
        rank = afd.rank if afd.rank is not None else vllm_config.parallel_config.data_parallel_rank
        model = self._afd_model()
        stats = ServeStats()
        # Before the first MoE kernel: its AMX path needs the process's AMX permission,
        # which native vLLM gets from earlier ops of the full model (see the function).
        request_amx_tiles()
        with set_current_vllm_config(vllm_config):
            blocks = model.afd_ffn_blocks()
            compute = FFNLayerCompute(
                blocks,
                vllm_config=vllm_config,
                # Ascend with the gate on Attention: that role adds the shared experts,
                # and (CAMP2p) the received top-k runs through vLLM-Ascend's comm flow.
                shared_experts_on_attention=shared_experts_on_attention(afd),
                external_routing=ffn_external_routing(afd, blocks),
            )
            identity = role_identity(model, vllm_config, afd)
            plane = afd
            if afd.ffn_expert_parallel:
                # Expert parallelism: this rank holds its expert shard only (allocated so
                # at construction) and talks to every attention rank on its own expert
                # plane (port + rank).
                from afd_moe_runners.expert_parallel import zero_foreign_experts
                from afd_moe_runners.identity import moe_layer_indices

                n = afd.num_ffn_ranks
                held = zero_foreign_experts(blocks, moe_layer_indices(blocks), rank, n)
                logger.info(
                    "AFD FFN rank %d of %d (expert parallel): %s", rank, n,
                    " ".join(f"{k}={v}" for k, v in held.items()),
                )  # fmt: skip
                plane = afd.expert_plane(rank)
                identity = {**identity, "expert_shard": f"{rank}/{n}"}
            warm_up_layers(compute, afd, rank)
            plane_rank = 0 if afd.ffn_expert_parallel else rank
            connector = create_connector(plane, rank=plane_rank, identity=identity)
            self._afd_connector = connector
            if getattr(self, "_afd_stop_requested", False):
                return {"exit_reason": "stopped before serving"}
            logger.info(
                "AFD FFN rank %d: waiting for attention ranks %s at %s:%d",
                rank,
                list(connector.topology.attention_peers_of(plane_rank)),
                plane.host,
                plane.port,
            )
            connector.init()
            metrics = ffn_metrics(rank)
            metrics.peers.set(len(connector.topology.attention_peers_of(plane_rank)))
            logger.info("AFD FFN rank %d: attention peers connected; serving", rank)
            try:
                while True:
                    batch = compute.serve_one(connector, timeout_s=None, metrics=metrics)
                    stats.layers_served += 1
                    stats.tokens_served += batch.header.num_tokens
            except AFDPeerLostError as exc:
                stats.exit_reason = f"peer gone: {exc}"
                stats.peer_lost = not exc.goodbye
            except AFDConnectorClosedError:
                stats.exit_reason = "stopped"
            finally:
                metrics.peers.set(0)  # /health turns 503 now, before the close
                connector.close()
        logger.info(
            "AFD FFN rank %d: served %d layer messages (%d tokens); %s",
            rank,
            stats.layers_served,
            stats.tokens_served,
            stats.exit_reason,
        )
        return {
            "layers_served": stats.layers_served,
            "tokens_served": stats.tokens_served,
            "exit_reason": stats.exit_reason,
            "peer_lost": stats.peer_lost,
        }

    def afd_stop(self) -> None:
        self._afd_stop_requested = True
        connector = getattr(self, "_afd_connector", None)
        if connector is not None:
            connector.close()


def warm_up_layers(compute: Any, afd: AFDConfig, rank: int) -> None:
    """Run every FFN layer this rank serves once, on a dummy batch of the payload kind
    the deployment sends (``FFNLayerCompute.warm_up``), and log what ran and how long it
    took. Called after the weights are final (expert parallelism zeroes the foreign
    experts first) and before the rank waits for its attention peers, so first-call
    costs land here and not in the Attention role's profiling run."""
    report = compute.warm_up(
        compute_gate_on_attention=afd.compute_gate_on_attention,
        routing_payload=afd.routing_payload,
        expert_parallel=(rank, afd.num_ffn_ranks) if afd.ffn_expert_parallel else None,
    )
    logger.info("AFD FFN rank %d: %s", rank, report.summary())


def run_ffn_server(engine_args: Any, *, health_host: str = "0.0.0.0", health_port: int = 0) -> int:
    """Start the FFN role; return the process exit code: 0 on SIGTERM / SIGINT or when
    its attention peers closed on purpose, 1 when they vanished (exited or crashed without
    closing) or anything failed.

    ``GET /health`` and ``GET /metrics`` are served on ``health_host:health_port`` (0: a
    free port, logged) from the start: 503 until the attention peers are connected, 200
    while serving, 503 again once they are gone or a stop was requested (see
    :func:`ffn_health`). When serving ended without a signal, the server keeps answering
    for ``AFD_FFN_LINGER_S`` seconds (default 0) before it exits, so that a health checker
    sees why and a scraper gets the final counters.
    """
    from vllm.v1.executor import Executor

    from afd.runtime.health import StatusServer, metrics_registry

    vllm_config = engine_args.create_engine_config()
    afd = _afd_config(vllm_config)
    if afd.role is not AFDRole.FFN:
        raise SystemExit(f"afd serve --role ffn got afd.role={afd.role.value!r}")
    linger_s = _linger_s()

    stop = threading.Event()
    signalled = threading.Event()
    requested: list[int] = []
    state = {"phase": "loading the model"}
    registry = metrics_registry()
    try:
        status = StatusServer(health_host, health_port, ffn_health(registry, state), registry)
    except OSError as exc:  # the port is taken: one line, not a traceback
        logger.error("AFD FFN server: %s; choose another --health-port", exc)
        return 1
    logger.info("AFD FFN health and metrics: %s/health %s/metrics", status.url, status.url)

    def on_signal(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        logger.info("AFD FFN server: %s received, stopping", name)
        requested.append(signum)
        state["stopped"] = f"stopping: {name} received"
        signalled.set()
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    try:
        executor = Executor.get_class(vllm_config)(vllm_config)
    except BaseException:
        status.close()
        raise
    try:
        inventory = executor.collective_rpc("afd_inventory")
        logger.info(
            "%s in %.1f s: model %s, inventory %s, connector %s at %s:%d",
            READY_MARKER,
            time.monotonic() - t0,
            vllm_config.model_config.model,
            inventory[0],
            afd.connector,
            afd.host,
            afd.port,
        )
        result: dict[str, Any] = {}

        def serve() -> None:
            try:
                result["value"] = executor.collective_rpc("afd_serve")
            except BaseException as exc:  # reported by the main thread
                result["error"] = exc
            finally:
                stop.set()

        server = threading.Thread(target=serve, name="afd-ffn-serve", daemon=True)
        state["phase"] = "waiting for the attention peers"
        server.start()
        while not stop.wait(0.2):
            pass
        if server.is_alive():
            executor.collective_rpc("afd_stop")
            server.join(timeout=10)
        code, reason = _outcome(result, requested)
        if code:
            logger.error("AFD FFN server %s", reason)
        else:
            logger.info("AFD FFN server %s", reason)
        if not requested and linger_s > 0:
            state.setdefault("stopped", reason)
            logger.info("AFD FFN server: exiting in %.1f s (%s)", linger_s, LINGER_ENV)
            signalled.wait(linger_s)
        return code
    finally:
        executor.shutdown()
        status.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


LINGER_ENV = "AFD_FFN_LINGER_S"


def _linger_s() -> float:
    raw = os.environ.get(LINGER_ENV, "") or "0"
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise SystemExit(f"{LINGER_ENV}: expected seconds in 0..3600, got {raw!r}")
    return value


def _outcome(result: dict[str, Any], requested: list[int]) -> tuple[int, str]:
    """Exit code and log line (after ``AFD FFN server ``) of a serving loop that ended."""
    if "error" in result:
        error = result["error"]
        return 1, f"failed: {type(error).__name__}: {error}"
    lost = [
        r["exit_reason"]
        for r in result.get("value") or []
        if isinstance(r, dict) and r.get("peer_lost")
    ]
    if lost and not requested:
        # Its attention peers vanished (no goodbye): the role cannot serve any more,
        # and a supervisor must not read that as a clean stop. Peers that closed on
        # purpose (a stopped deployment) end the FFN cleanly.
        return 1, f"stopped: {lost[0]}"
    reasons = [
        str(r.get("exit_reason") or r) for r in result.get("value") or [] if isinstance(r, dict)
    ]
    return 0, f"stopped: {'; '.join(reasons) or result.get('value')}"


def ffn_health(registry: Any, state: dict[str, str]) -> Any:
    """The FFN server's health check: healthy while its serving loop runs with its
    attention peers connected (``afd_ffn_peers_connected`` > 0, set by the worker, which
    may run in another process); unhealthy before (``state["phase"]`` says what it is
    doing), once a stop was requested or serving ended (``state["stopped"]``), and once
    the peers are gone."""
    from afd.runtime.health import gauge_total

    seen = threading.Event()

    def check() -> tuple[bool, str]:
        stopped = state.get("stopped")
        if stopped:
            return False, stopped
        peers = gauge_total(registry, "afd_ffn_peers_connected")
        if peers > 0:
            seen.set()
            return True, f"serving {peers:.0f} attention peer(s)"
        if seen.is_set():
            return False, "attention peers gone"
        return False, state["phase"]

    return check
