"""The FFN server's /health and /metrics: the status server, the multiprocess folder its
worker reports through, the health check's states, and the ``--health-*`` options."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from afd.runtime.health import MULTIPROC_DIR_ENV, StatusServer, gauge_total, multiproc_dir


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_status_server_answers_health_metrics_and_404() -> None:
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    Counter("afd_test_things", "things", registry=registry).inc(3)
    state: dict[str, Any] = {"ok": False, "reason": "waiting for the attention peers"}
    status = StatusServer("127.0.0.1", 0, lambda: (state["ok"], state["reason"]), registry)
    try:
        assert status.port > 0 and status.url == f"http://127.0.0.1:{status.port}"
        assert _get(f"{status.url}/health")[::2] == (503, "waiting for the attention peers\n")
        state.update(ok=True, reason="serving")
        assert _get(f"{status.url}/health/")[::2] == (200, "serving\n")
        code, content_type, body = _get(f"{status.url}/metrics")
        assert code == 200 and content_type.startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert families["afd_test_things"].samples[0].value == 3
        assert _get(f"{status.url}/nope")[0] == 404
    finally:
        status.close()


def test_a_failing_health_check_is_a_503_with_the_reason() -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    status = StatusServer("127.0.0.1", 0, broken, object())
    try:
        assert _get(f"{status.url}/health")[::2] == (503, "health check failed: boom\n")
    finally:
        status.close()


def test_a_port_in_use_is_named() -> None:
    status = StatusServer("127.0.0.1", 0, lambda: (True, ""), object())
    try:
        with pytest.raises(
            OSError, match=rf"cannot serve /health and /metrics on .*:{status.port}"
        ):
            StatusServer("127.0.0.1", status.port, lambda: (True, ""), object())
    finally:
        status.close()


def test_multiproc_dir_is_fresh_and_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_DIR_ENV, "/somewhere/else")
    with multiproc_dir("afd-test-", keep_given=False) as path:
        assert os.environ[MULTIPROC_DIR_ENV] == path != "/somewhere/else"
        assert Path(path).is_dir() and not any(Path(path).iterdir())
    assert not Path(path).exists()
    assert os.environ[MULTIPROC_DIR_ENV] == "/somewhere/else"
    with multiproc_dir("afd-test-", keep_given=True) as given:
        assert given == "/somewhere/else"
    monkeypatch.delenv(MULTIPROC_DIR_ENV)
    with multiproc_dir("afd-test-", keep_given=True) as path:
        assert os.environ[MULTIPROC_DIR_ENV] == path
    assert MULTIPROC_DIR_ENV not in os.environ and not Path(path).exists()


_WORKER = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace as NS
    from afd_moe_runners.metrics import ffn_metrics

    m = ffn_metrics(0)
    batch = NS(header=NS(num_tokens=5), payload=NS(
        hidden_states=NS(numel=lambda: 10, element_size=lambda: 2),
        topk_ids=None, topk_weights=None, router_logits=None, token_ids=None))
    result = NS(output=NS(numel=lambda: 10, element_size=lambda: 2), shared_output=None)
    m.served(batch, result, 2_000_000)
    for line in sys.stdin:  # one peer count per line, acknowledged
        m.peers.set(int(line))
        print("ok", flush=True)
    """
)


def test_worker_metrics_in_another_process_reach_the_health_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FFN worker may run in another process (a multiprocess executor): its values
    must reach the server's /metrics and /health through the multiprocess folder."""

    from afd.runtime.ffn_server import ffn_health
    from afd.runtime.health import metrics_registry

    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    registry = metrics_registry()
    state = {"phase": "waiting for the attention peers"}
    check = ffn_health(registry, state)
    assert check() == (False, "waiting for the attention peers")
    env = {**os.environ, MULTIPROC_DIR_ENV: str(tmp_path)}
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert worker.stdin is not None and worker.stdout is not None

    def peers(n: int) -> None:
        worker.stdin.write(f"{n}\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "ok\n"

    try:
        _check_worker_metrics(registry, check, state, peers)
    finally:
        worker.kill()
        worker.wait(10)


def _check_worker_metrics(registry: Any, check: Any, state: dict[str, str], peers: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    peers(2)
    assert gauge_total(registry, "afd_ffn_peers_connected") == 2
    assert check() == (True, "serving 2 attention peer(s)")
    status = StatusServer("127.0.0.1", 0, check, registry)
    try:
        body = _get(f"{status.url}/metrics")[2]
    finally:
        status.close()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(body)
        for s in f.samples
    }
    assert samples[("afd_ffn_layers_served_total", None)] == 1
    assert samples[("afd_ffn_tokens_served_total", None)] == 5
    assert samples[("afd_ffn_received_bytes_total", None)] == 20
    assert samples[("afd_ffn_compute_seconds_count", None)] == 1
    assert samples[("afd_ffn_compute_seconds_bucket", "0.0025")] == 1
    assert samples[("afd_ffn_compute_seconds_bucket", "0.001")] == 0
    # The worker's serving loop ended (it sets the gauge to 0): peers gone, not "waiting".
    peers(0)
    assert check() == (False, "attention peers gone")
    state["stopped"] = "stopping: SIGTERM received"
    assert check() == (False, "stopping: SIGTERM received")


def test_health_options_are_taken_out_of_the_vllm_args() -> None:
    from afd.runtime.serve import health_options

    args = ["--enforce-eager", "--health-port", "9100", "--health-host=127.0.0.1", "--x"]
    assert health_options(args) == ("127.0.0.1", 9100)
    assert args == ["--enforce-eager", "--x"]
    assert health_options([]) == ("0.0.0.0", 0)
    for bad in ("http", "70000", "-1"):
        with pytest.raises(Exception, match=r"--health-port: expected a port in 0\.\.65535"):
            health_options(["--health-port", bad])


def test_status_server_serves_while_another_thread_holds_the_gil_briefly() -> None:
    # Scrapes are answered from their own threads: a slow /metrics does not block /health.
    release = threading.Event()

    class SlowRegistry:
        def collect(self) -> Any:
            release.wait(10)
            return iter(())

    status = StatusServer("127.0.0.1", 0, lambda: (True, "ok"), SlowRegistry())
    try:
        slow = threading.Thread(target=_get, args=(f"{status.url}/metrics",), daemon=True)
        slow.start()
        assert _get(f"{status.url}/health")[0] == 200
        release.set()
        slow.join(10)
    finally:
        release.set()
        status.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.matrix  # runs in `nox -s tests-matrix` (CI runs it too)
def test_a_busy_health_port_stops_the_ffn_server_with_one_line(tmp_path: Path) -> None:
    import importlib.util
    import socket

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from afd.tools.models.tiny import generate_tiny_checkpoint

    model = generate_tiny_checkpoint("deepseek_v2", tmp_path / "dsv2")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [
            sys.executable, "-m", "afd.cli", "serve", "--role", "ffn", str(model),
            "--enforce-eager", "--health-host", "127.0.0.1", "--health-port", str(port),
            "--additional-config", '{"afd": {"port": 1}}',
        ]  # fmt: skip
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert f"cannot serve /health and /metrics on 127.0.0.1:{port}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_multiproc_dir_switches_an_already_imported_prometheus_client() -> None:
    code = textwrap.dedent(
        """
        import os
        from prometheus_client import Counter, values
        from afd.runtime.health import MULTIPROC_DIR_ENV, multiproc_dir, metrics_registry

        os.environ.pop(MULTIPROC_DIR_ENV, None)
        with multiproc_dir("afd-test-", keep_given=False) as path:
            Counter("afd_test_late", "made after the switch").inc(7)
            assert os.listdir(path), "nothing written to the multiprocess folder"
            registry = metrics_registry()
            assert registry.get_sample_value("afd_test_late_total") == 7
        # Afterwards metrics are this process's own again (the folder is gone).
        Counter("afd_test_after", "made after the block").inc()
        assert values.ValueClass is values.MutexValue
        """
    )
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_DIR_ENV}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_outcome_of_the_serving_loop() -> None:
    from afd.runtime.ffn_server import _outcome

    def ended(*, lost: bool) -> dict[str, Any]:
        return {"value": [{"exit_reason": "peer gone: bye", "peer_lost": lost}]}

    assert _outcome(ended(lost=False), []) == (0, "stopped: peer gone: bye")  # a goodbye
    assert _outcome(ended(lost=True), []) == (1, "stopped: peer gone: bye")  # vanished
    assert _outcome(ended(lost=True), [15]) == (0, "stopped: peer gone: bye")  # SIGTERM
    assert _outcome({"error": RuntimeError("boom")}, []) == (1, "failed: RuntimeError: boom")


def test_linger_seconds_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from afd.runtime.ffn_server import LINGER_ENV, _linger_s

    monkeypatch.delenv(LINGER_ENV, raising=False)
    assert _linger_s() == 0
    monkeypatch.setenv(LINGER_ENV, "2.5")
    assert _linger_s() == 2.5
    for bad in ("soon", "-1"):
        monkeypatch.setenv(LINGER_ENV, bad)
        with pytest.raises(SystemExit, match=rf"{LINGER_ENV}: expected seconds in 0\.\.3600"):
            _linger_s()
