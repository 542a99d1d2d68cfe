"""``afd bench``'s native baselines (all cores / vLLM's default binding), the reference
it picks for the AFD/native ratios, and ``afd demo``'s native spec; no vLLM process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

import afd.tools.bench as bench
from afd.launch import Deployment, DeploymentSpec
from afd.tools.bench import (
    _plan_runs,
    _ratios,
    add_bench_arguments,
    format_table,
    native_config_cpus,
    parse_micro_batches,
    pick_native_reference,
)
from afd.tools.demo import add_demo_arguments, demo_spec, native_spec


def _lv(tok_s: float, tpot: float = 1.0) -> dict[str, Any]:
    return {
        "concurrency": 1,
        "requests": 8,
        "completed": 8,
        "errors": [],
        "output_tok_s": tok_s,
        "ttft_ms": {"median": 10.0, "p99": 20.0},
        "tpot_ms": {"median": tpot, "p99": tpot * 2},
        "per_request": [],
    }


def test_reference_is_the_faster_native_config_per_level() -> None:
    configs = {
        "all-cores": {"1": _lv(100.0), "4": _lv(300.0), "8": _lv(500.0)},
        "auto": {"1": _lv(120.0), "4": _lv(300.0), "8": _lv(400.0)},
    }
    results, chosen = pick_native_reference(configs, [1, 4, 8])
    assert chosen == {"1": "auto", "4": "all-cores", "8": "all-cores"}  # a tie: the first
    assert [results[c]["output_tok_s"] for c in ("1", "4", "8")] == [120.0, 300.0, 500.0]
    assert results["1"]["native_config"] == "auto"
    assert "native_config" not in configs["auto"]["1"]  # the inputs are left alone
    # one config: it is the reference
    results, chosen = pick_native_reference({"auto": configs["auto"]}, [1, 4])
    assert chosen == {"1": "auto", "4": "auto"} and results["4"]["output_tok_s"] == 300.0


def test_ratios_use_the_reference() -> None:
    configs = {"all-cores": {"1": _lv(100.0, 2.0)}, "auto": {"1": _lv(200.0, 1.0)}}
    native, _ = pick_native_reference(configs, [1])
    ratios = _ratios({"native": native, "afd": {"1": _lv(50.0, 4.0)}}, [1])
    assert ratios["1"]["output_tok_s"] == 0.25 and ratios["1"]["tpot_median"] == 4.0


def test_native_config_cpus() -> None:
    assert native_config_cpus("all-cores", [0, 1]) == "0-1"
    assert native_config_cpus("all-cores", [0, 2, 3]) == "0,2-3"
    assert native_config_cpus("auto", [0, 1]) == "auto"
    with pytest.raises(ValueError, match="native config"):
        native_config_cpus("half", [0, 1])


def test_native_runs_get_their_config_cpus_not_the_attention_flag() -> None:
    base = DeploymentSpec(model="/m", attention={"cpus": "0"}, ffn={"cpus": "1"})
    runs = _plan_runs(base, ["native", "afd"], ["all-cores", "auto"], [0, 1])
    assert [name for name, _ in runs] == ["native/all-cores", "native/auto", "afd"]
    (_, all_cores), (_, auto), (_, afd) = runs
    assert all_cores.native and all_cores.attention.cpus == ["0-1"]
    assert auto.native and auto.attention.cpus == ["auto"]
    assert not afd.native and afd.attention.cpus == ["0"] and afd.ffn.cpus == ["1"]
    assert base.attention.cpus == ["0"]  # not changed by the native runs
    # what the launcher then sets for them
    for spec, want in ((all_cores, "0-1"), (auto, "auto")):
        dep = Deployment(spec, visible_devices=[], usable_cpus=[0, 1])
        assert dep.plan_cpus() == {"native0": want}
    assert [n for n, _ in _plan_runs(base, ["native"], ["auto"], [0, 1])] == ["native/auto"]


def _bench_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_bench_arguments(ap)
    return ap.parse_args(argv)


def test_bench_flags() -> None:
    args = _bench_args([])
    assert args.native_configs == "all-cores,auto"
    assert args.connector is None  # the launcher's default (shared memory)
    assert args.attention_cpus is None and args.ffn_cpus is None
    args = _bench_args(["--attention-cpus", "0", "--ffn-cpus", "1", "--native-configs", "auto"])
    assert (args.attention_cpus, args.ffn_cpus, args.native_configs) == ("0", "1", "auto")


def test_bad_native_configs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run_bench(_bench_args(["--native-configs", "all-cores,half"])) == 2
    assert "native-configs: expected some of all-cores, auto" in capsys.readouterr().err


class _FakeDeployment:
    """Stands in for a deployment: its throughput depends on its CPUs."""

    TOK_S: ClassVar[dict[str, dict[int, float]]] = {
        "0-1": {1: 100.0, 4: 400.0},
        "auto": {1: 150.0, 4: 300.0},
        "afd": {1: 75.0, 4: 200.0},
    }

    def __init__(self, spec: DeploymentSpec, **_: Any) -> None:
        self.spec = spec
        self.url = "http://fake"
        self.startup_s = 1.0
        self.cpus = {"native0": spec.attention.cpus[0]} if spec.native else {"attn": "0"}

    def __enter__(self) -> _FakeDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _fake_runs(monkeypatch: pytest.MonkeyPatch, deployment: Any, level: Any) -> None:
    """``afd bench`` with fake deployments and levels on a 2-CPU host without CUDA."""
    monkeypatch.setattr(bench, "Deployment", deployment)
    monkeypatch.setattr(bench, "run_level", level)
    monkeypatch.setattr(bench, "served_model", lambda url: "m")
    monkeypatch.setattr(bench, "stream_completion", lambda *a, **k: None)
    monkeypatch.setattr(bench, "usable_cpus", lambda: [0, 1])
    monkeypatch.setattr(bench, "detect_cuda_devices", lambda: [])


def test_bench_report_keeps_old_keys_and_adds_the_native_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current: list[_FakeDeployment] = []

    def fake_deployment(spec: DeploymentSpec, **kw: Any) -> _FakeDeployment:
        current.append(_FakeDeployment(spec, **kw))
        return current[-1]

    def fake_level(url: str, prompts: Any, c: int, n: int, out_len: int, **kw: Any) -> dict:
        dep = current[-1]
        key = dep.cpus["native0"] if dep.spec.native else "afd"
        return _lv(_FakeDeployment.TOK_S[key][c])

    _fake_runs(monkeypatch, fake_deployment, fake_level)
    out = tmp_path / "out"
    args = _bench_args(
        ["--model", str(tmp_path), "--concurrency", "1,4", "--out", str(out), "--no-plot"]
    )
    assert bench.run_bench(args) == 0
    report = json.loads((out / "bench.json").read_text())
    # old keys
    assert set(report["results"]) == {"native", "afd"}
    assert report["results"]["native"]["1"]["output_tok_s"] == 150.0  # auto was faster
    assert report["results"]["native"]["4"]["output_tok_s"] == 400.0  # all cores were
    assert report["ratio_afd_over_native"]["1"]["output_tok_s"] == 0.5
    assert report["ratio_afd_over_native"]["4"]["output_tok_s"] == 0.5
    assert report["startup_s"]["native"] == 1.0 and report["startup_s"]["afd"] == 1.0
    assert report["settings"]["connector"] == "P2pShmAFDConnector"
    # new keys
    assert report["native_reference"] == {"1": "auto", "4": "all-cores"}
    assert report["native_configs"]["all-cores"]["cpus"] == "0-1"
    assert report["native_configs"]["auto"]["results"]["4"]["output_tok_s"] == 300.0
    assert report["settings"]["cpus"]["native/all-cores"] == {"native0": "0-1"}
    table = format_table(report)
    assert "native all-cores tok/s" in table and "native auto tok/s" in table
    assert "native ref" in table


def test_parse_micro_batches() -> None:
    assert parse_micro_batches("2") == [2]
    assert parse_micro_batches("1, 2,3") == [1, 2, 3]
    assert parse_micro_batches(3) == [3]
    for bad in ("0", "1,1", "", "two"):
        with pytest.raises(ValueError, match="--micro-batches"):
            parse_micro_batches(bad)


def test_one_afd_run_per_micro_batch_count() -> None:
    base = DeploymentSpec(model="/m", afd={"num_micro_batches": 3, "transfer_timeout_s": 9})
    runs = _plan_runs(base, ["native", "afd"], ["auto"], [0, 1], [1, 2])
    assert [name for name, _ in runs] == ["native/auto", "afd/m1", "afd/m2"]
    assert runs[1][1].to_dict()["afd"] == {"transfer_timeout_s": 9}  # m = 1: the default
    assert runs[2][1].to_dict()["afd"] == {"transfer_timeout_s": 9, "num_micro_batches": 2}
    assert [n for n, _ in _plan_runs(base, ["afd"], [], [0, 1], [2])] == ["afd"]


def test_bench_measures_every_m_and_reports_the_best_per_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tok_s = {1: {1: 80.0, 16: 600.0}, 2: {1: 70.0, 16: 700.0}, 3: {1: 60.0, 16: 650.0}}
    native = {1: 100.0, 16: 800.0}
    current: list[DeploymentSpec] = []

    def fake_deployment(spec: DeploymentSpec, **kw: Any) -> _FakeDeployment:
        current.append(spec)
        return _FakeDeployment(spec, **kw)

    def fake_level(url: str, prompts: Any, c: int, n: int, out_len: int, **kw: Any) -> dict:
        spec = current[-1]
        if spec.native:
            return _lv(native[c])
        return _lv(tok_s[spec.afd.num_micro_batches][c])

    _fake_runs(monkeypatch, fake_deployment, fake_level)
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path), "--concurrency", "1,16", "--out", str(out), "--no-plot"]
    args = _bench_args([*argv, "--native-configs", "auto", "--micro-batches", "1,2,3"])
    assert bench.run_bench(args) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["num_micro_batches"] == [1, 2, 3]
    assert report["afd_best_micro_batches"] == {"1": 1, "16": 2}
    assert report["results"]["afd"]["16"]["output_tok_s"] == 700.0
    assert report["results"]["afd"]["16"]["num_micro_batches"] == 2
    assert report["ratio_afd_over_native"]["16"]["output_tok_s"] == 0.875
    by_m = report["afd_micro_batches"]
    assert by_m["3"]["results"]["16"]["output_tok_s"] == 650.0
    assert by_m["1"]["ratio_over_native"]["1"]["output_tok_s"] == 0.8
    table = capsys.readouterr().out
    assert "afd m=3 tok/s" in table and "m=2/native" in table and "best m" in table
    assert bench.run_bench(_bench_args([*argv, "--micro-batches", "1,0"])) == 2


def test_repeats_alternate_the_order_and_report_medians_and_each_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # tok/s per start of each deployment (native, afd/m1, afd/m2), in start order.
    native = iter([1000.0, 600.0, 900.0])
    afd = {1: iter([500.0, 450.0, 700.0]), 2: iter([400.0, 480.0, 650.0])}
    # start-up seconds per start: the first start of each kind compiles (slow)
    native_startup = iter([90.0, 60.0, 62.0])
    afd_startup = {1: iter([100.0, 70.0, 75.0]), 2: iter([110.0, 71.0, 72.0])}
    order: list[str] = []
    current: list[float] = []

    def fake_deployment(spec: DeploymentSpec, **kw: Any) -> _FakeDeployment:
        m = spec.afd.num_micro_batches
        order.append("native" if spec.native else f"m{m}")
        current.append(next(native) if spec.native else next(afd[m]))
        dep = _FakeDeployment(spec, **kw)
        dep.startup_s = next(native_startup) if spec.native else next(afd_startup[m])
        return dep

    def fake_level(url: str, prompts: Any, c: int, n: int, out_len: int, **kw: Any) -> dict:
        return _lv(current[-1])

    _fake_runs(monkeypatch, fake_deployment, fake_level)
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path), "--concurrency", "8", "--out", str(out), "--no-plot"]
    argv += ["--native-configs", "auto", "--micro-batches", "1,2", "--native-modes", "compiled"]
    assert bench.run_bench(_bench_args([*argv, "--repeat", "3"])) == 0
    assert order == ["native", "m1", "m2", "m2", "m1", "native", "native", "m1", "m2"]
    report = json.loads((out / "bench.json").read_text())
    # per deployment: the median repeat; the headline ratio divides the medians
    assert report["results"]["native"]["8"]["output_tok_s"] == 900.0
    assert report["results"]["native"]["8"]["repeats_output_tok_s"] == [1000.0, 600.0, 900.0]
    assert report["afd_micro_batches"]["1"]["results"]["8"]["output_tok_s"] == 500.0
    assert report["afd_micro_batches"]["2"]["results"]["8"]["output_tok_s"] == 480.0
    assert report["ratio_afd_over_native"]["8"]["output_tok_s"] == round(500 / 900, 3)
    # per repeat: best AFD m over best native of that repeat
    repeats = report["repeats"]
    assert repeats["ratio_afd_over_native"]["8"] == [0.5, 0.8, round(700 / 900, 3)]
    assert repeats["median"]["8"] == round(700 / 900, 3)
    # start-up: every repeat's, and their median (not the last repeat's)
    assert report["startup_repeats_s"]["native/auto"] == [90.0, 60.0, 62.0]
    assert report["startup_s"]["native/auto"] == 62.0
    assert report["afd_micro_batches"]["1"]["startup_s"] == 75.0
    assert report["afd_micro_batches"]["2"]["startup_s"] == 72.0
    assert report["startup_ratio_afd_over_native_compiled"] == round(75 / 62, 2)
    printed = capsys.readouterr().out
    assert "c=8: 0.50 0.80 0.78  (median 0.78)" in printed
    assert bench.run_bench(_bench_args([*argv, "--repeat", "0"])) == 2
    assert bench.run_bench(_bench_args([*argv, "--repeat", "2", "--profile"])) == 2
    assert "--profile records one run" in capsys.readouterr().err


def test_table_without_native_configs_still_works() -> None:
    report = {
        "settings": {"concurrency": [1]},
        "results": {"native": {"1": _lv(10.0)}, "afd": {"1": _lv(5.0)}},
        "ratio_afd_over_native": {"1": {"output_tok_s": 0.5, "tpot_median": 1.0}},
    }
    table = format_table(report)
    assert "native ref" not in table and "0.50" in table


# ---------------------------------------------------------------- demo


def test_demo_cpus_flags_and_native_gets_every_cpu() -> None:
    ap = argparse.ArgumentParser()
    add_demo_arguments(ap)
    args = ap.parse_args(["--attention-cpus", "1", "--ffn-cpus", "0"])
    spec = demo_spec("/m", args)
    assert spec.attention.cpus == ["1"] and spec.ffn.cpus == ["0"]
    assert spec.connector == "P2pShmAFDConnector"
    native = native_spec(spec)
    assert native.native and native.attention.cpus is None and spec.attention.cpus == ["1"]
    dep = Deployment(native, visible_devices=[], usable_cpus=[0, 1])
    assert dep.plan_cpus() == {"native0": "0-1"}
    assert demo_spec("/m", ap.parse_args([])).attention.cpus is None


def test_native_and_afd_compile_modes_and_both_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Native runs compiled and eager by default (the reference is the fastest of all);
    AFD's first mode is its result; the report gives AFD's ratio against the best native
    run and against the best eager one."""
    tok_s = {("native", False): 1000.0, ("native", True): 600.0}
    tok_s |= {("afd", False): 500.0, ("afd", True): 300.0}
    current: list[DeploymentSpec] = []

    def fake_deployment(spec: DeploymentSpec, **kw: Any) -> _FakeDeployment:
        current.append(spec)
        return _FakeDeployment(spec, **kw)

    def fake_level(url: str, prompts: Any, c: int, n: int, out_len: int, **kw: Any) -> dict:
        spec = current[-1]
        return _lv(tok_s[("native" if spec.native else "afd", spec.enforce_eager)])

    _fake_runs(monkeypatch, fake_deployment, fake_level)
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path), "--concurrency", "16", "--out", str(out), "--no-plot"]
    argv += ["--native-configs", "auto", "--afd-modes", "compiled,eager"]
    assert bench.run_bench(_bench_args(argv)) == 0
    started = [(s.native, s.enforce_eager) for s in current]
    assert started == [(True, False), (True, True), (False, False), (False, True)]
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["native_modes"] == ["compiled", "eager"]
    assert report["native_reference"] == {"16": "auto"}  # compiled: the faster one
    assert report["native_configs"]["auto/eager"]["cpus"] == "auto"
    assert report["results"]["afd"]["16"]["output_tok_s"] == 500.0  # compiled AFD
    assert report["ratio_afd_over_native"]["16"]["output_tok_s"] == 0.5
    assert report["ratio_afd_over_native_eager"]["16"]["output_tok_s"] == round(500 / 600, 3)
    assert report["startup_ratio_afd_over_native_compiled"] == 1.0  # the fakes: 1 s each
    eager = report["afd_modes"]["eager"]
    assert eager["results"]["16"]["output_tok_s"] == 300.0
    assert eager["ratio_over_native"]["16"]["output_tok_s"] == 0.3
    assert eager["ratio_over_native_eager"]["16"]["output_tok_s"] == 0.5
    table = capsys.readouterr().out
    assert "native auto/eager tok/s" in table and "afd eager tok/s" in table
    assert "AFD/native-eager tok/s" in table
    # AFD eager first: it is AFD's result
    current.clear()
    argv[-1] = "eager,compiled"
    assert bench.run_bench(_bench_args(argv)) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["results"]["afd"]["16"]["output_tok_s"] == 300.0
    assert bench.run_bench(_bench_args([*argv[:-2], "--afd-modes", "fast"])) == 2
    assert bench.run_bench(_bench_args([*argv, "--native-modes", "eager,eager"])) == 2


def test_demo_runs_compiled_in_float32_by_default() -> None:
    ap = argparse.ArgumentParser()
    add_demo_arguments(ap)
    spec = demo_spec("/m", ap.parse_args([]))
    assert (spec.enforce_eager, spec.dtype) == (False, "float32")
    assert "--enforce-eager" not in native_spec(spec).engine_args()  # both sides compiled
    spec = demo_spec("/m", ap.parse_args(["--enforce-eager", "--dtype", "bfloat16"]))
    assert (spec.enforce_eager, spec.dtype) == (True, "bfloat16")
    assert "--enforce-eager" in native_spec(spec).engine_args()
