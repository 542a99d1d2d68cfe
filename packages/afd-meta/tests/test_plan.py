"""``afd plan``'s performance model, search, spec and calibration fit (no engine started)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from afd.cli import main
from afd.launch.errors import SpecError
from afd.plan.calibrate import fit, repeat_dirs
from afd.plan.hardware import PRESETS, Hardware, hardware_toml, load_hardware
from afd.plan.model import Layout, Prediction, Workload, cpu_placement, experts_hit, predict
from afd.plan.search import Constraints, search
from afd.plan.shapes import load_shape, shape_from_config
from afd.plan.spec import plan_toml, validate_toml

# A small GQA MoE model and a device with round figures, so that the model's times can
# be computed by hand (see test_hand_computed_*).
SMALL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}
# The bench-size Qwen3-MoE of `afd models tiny --arch qwen3_moe --size bench`.
BENCH = {
    **SMALL,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "vocab_size": 882,
    "tie_word_embeddings": False,
}
ROUND = Hardware(
    name="round",
    kind="gpu",
    flops=1e12,
    mem_bw=1e9,
    mem_bytes=1e12,
    link_bw=1e9,
    link_latency_s=1e-5,
    attention_flops_eff=1.0,
    ffn_flops_eff=1.0,
    bw_eff=1.0,
    attention_layer_s=0.0,
    ffn_layer_s=0.0,
    exchange_s=0.0,
    step_s=0.0,
    reserve_bytes=0.0,
)


def test_small_shape_counts_match_the_config():
    s = shape_from_config(SMALL)
    # q, k, v: 1024 x 128 x (8 + 8 + 8); o: 8 x 128 x 1024
    assert s.attention_params == 1024 * 128 * 24 + 8 * 128 * 1024 == 4_194_304
    assert s.expert_params == 3 * 1024 * 512
    assert (s.moe_layers, s.dense_layers, s.kv_elems_per_token) == (2, 0, 2 * 8 * 128)


def test_experts_hit_by_hand():
    # 8 experts, top-2, 2 tokens: 8 * (1 - (6/8)^2) = 3.5
    assert experts_hit(2, 8, 2) == pytest.approx(3.5)
    assert experts_hit(0, 8, 2) == 0.0
    assert experts_hit(10_000, 8, 2) == pytest.approx(8.0)


def test_hand_computed_one_token_1a1f():
    s = shape_from_config(SMALL)
    p = predict(s, ROUND, Layout(), Workload(batch=1, context=0))
    # attention: 4_194_304 weights x 2 B at 1 GB/s (8.4 MFLOP at 1 TFLOP/s is less)
    assert p.attention_s == pytest.approx(8.388608e-3)
    # FFN: 8 * (1 - 6/8) = 2 experts of 1_572_864 weights + the 8192-weight router, x 2 B
    assert p.ffn_s == pytest.approx((2 * 1_572_864 + 8192) * 2 / 1e9)
    # one way: 10 us + one row of 1024 x 2 B at 1 GB/s
    assert p.transfer_s == pytest.approx(1e-5 + 2048 / 1e9)
    layer = 8.388608e-3 + 6.30784e-3 + 2 * 12.048e-6
    assert p.layer_s == pytest.approx(layer)
    # 2 layers + the (tied) LM head: 1000 x 1024 x 2 B
    assert p.tpot_s == pytest.approx(2 * layer + 2.048e-3)
    assert p.throughput_per_device == pytest.approx(1 / p.tpot_s / 2)


def test_hand_computed_ping_pong_two_micro_batches():
    s = shape_from_config(SMALL)
    p = predict(s, ROUND, Layout(micro_batches=2), Workload(batch=2, context=0))
    # each micro-batch: 1 token, the times of the one-token case; the attention's two
    # blocks back to back (16.78 ms) are longer than one round trip (14.72 ms)
    assert p.layer_s == pytest.approx(2 * 8.388608e-3)
    assert p.bound == "attention"


def test_hand_computed_kv_reads_grow_attention():
    s = shape_from_config(SMALL)
    short = predict(s, ROUND, Layout(), Workload(batch=1, context=0))
    long = predict(s, ROUND, Layout(), Workload(batch=1, context=1000))
    # 1000 cached tokens x 2048 KV elements x 2 B more to read per layer
    assert long.attention_s - short.attention_s == pytest.approx(1000 * 2048 * 2 / 1e9)


@pytest.mark.parametrize(
    ("model", "hw", "layout"),
    [
        ("DeepSeek-V3", "H800-SXM", Layout(4, 4, 16, True, 2, True)),
        ("Qwen3-235B-A22B", "H100-SXM", Layout(2, 2, 4, True, 3, True)),
        ("Qwen3-30B-A3B", "cpu", Layout(2, 1, 1, False, 1)),
        ("Qwen3-30B-A3B", "Ascend-A3", Layout(3, 1, 2, False, 2)),
    ],
)
def test_tpot_and_memory_grow_with_batch(model, hw, layout):
    shape, device = load_shape(model), load_hardware(hw)
    last = None
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        p = predict(shape, device, layout, Workload(batch=batch, context=4096))
        if last is not None:
            assert p.tpot_s >= last.tpot_s
            assert p.mem_attention_bytes >= last.mem_attention_bytes
            assert p.mem_ffn_bytes >= last.mem_ffn_bytes
            assert p.attention_s >= last.attention_s and p.ffn_s >= last.ffn_s
        last = p


def test_memory_is_a_hard_constraint():
    v3 = load_shape("DeepSeek-V3", weight_bytes=2.0)
    h100 = load_hardware("H100-SXM")
    # one FFN rank holding all 256 experts x 58 layers in bf16 (~1.3 TB) cannot fit
    p = predict(v3, h100, Layout(1, 8, 1, False, 1), Workload(batch=8, context=4096))
    assert not p.fits and p.why_not.startswith("FFN device")
    # nor an attention rank whose KV cache outgrows the device
    q = predict(v3, h100, Layout(1, 1, 32, True, 1, True), Workload(batch=512, context=65536))
    assert not q.fits and q.why_not.startswith("attention device")
    plans = search(v3, h100, Constraints(devices=48, context=4096))
    assert plans
    for plan in plans:
        assert plan.mem_ffn_bytes <= plan.mem_limit_bytes
        assert plan.mem_attention_bytes <= plan.mem_limit_bytes
        assert plan.layout.devices <= 48
    # bf16 experts need at least 1.3 TB / (80 GB x 0.9) FFN ranks
    assert min(p.layout.num_ffn for p in plans) >= 18


def test_tpot_target_is_met_and_binds():
    v3, h800 = load_shape("DeepSeek-V3"), load_hardware("H800-SXM")
    free = search(v3, h800, Constraints(devices=40, context=4096))
    tight = search(v3, h800, Constraints(devices=40, context=4096, tpot_s=0.05))
    assert all(p.tpot_s <= 0.05 for p in tight)
    assert max(p.tpot_s for p in free) > 0.05
    assert tight[0].throughput_per_device <= free[0].throughput_per_device


def test_deepseek_v3_h800_plan_is_a_spec_the_launcher_accepts(tmp_path):
    v3, h800 = load_shape("DeepSeek-V3"), load_hardware("H800-SXM")
    best = search(v3, h800, Constraints(devices=32, context=4096, tpot_s=0.1))[0]
    text = plan_toml(best, v3, h800, "deepseek-ai/DeepSeek-V3", 4096)
    validate_toml(text)  # raises when refused
    spec = tomllib.loads(text)
    lay = best.layout
    assert spec["num_attention"] == lay.num_attention
    assert spec["attention_tensor_parallel_size"] == lay.attention_tp
    assert spec["num_ffn"] == lay.num_ffn
    assert spec["ffn_expert_parallel"] == lay.ffn_ep
    assert spec["afd"]["num_micro_batches"] == lay.micro_batches
    assert lay.devices <= 32


def test_the_spec_check_refuses_what_the_launcher_refuses():
    s = shape_from_config(SMALL)
    bad = dataclasses.replace(predict(s, ROUND, Layout(), Workload(1, 16)), layout=Layout(1, 1, 2))
    with pytest.raises(SpecError, match="num_ffn"):
        validate_toml(plan_toml(bad, s, ROUND, "/models/x", 16))


def test_cli_writes_the_best_plan(tmp_path, capsys):
    out = tmp_path / "spec.toml"
    rc = main(
        [
            "plan",
            "--model",
            "DeepSeek-V3",
            "--hardware",
            "H800-SXM",
            "--tpot-ms",
            "100",
            "--devices",
            "32",
            "--context",
            "4096",
            "--out",
            str(out),
            "--top",
            "3",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "TPOT ms" in text and "tok/s/dev" in text
    assert len([line for line in text.splitlines() if line[:2].strip() in "123"]) >= 3
    assert tomllib.loads(out.read_text())["model"] == "deepseek-ai/DeepSeek-V3"


def test_cli_pinned_layout_and_bad_input(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(BENCH))
    rc = main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--hardware",
            "cpu",
            "--num-attention",
            "2",
            "--num-ffn",
            "1",
            "--attention-tp",
            "1",
            "--micro-batches",
            "1",
            "--ffn-expert-parallel",
            "false",
            "--concurrency",
            "8",
            "--context",
            "48",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "2A 1F m=1" in text and "4.0" in text
    assert main(["plan", "--model", "DeepSeek-V3", "--hardware", "nope"]) == 2
    err = capsys.readouterr().err
    assert "afd plan: error: hardware 'nope'" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--model", str(tmp_path / "none"), "--hardware", "cpu"]) == 2


def test_checkpoint_config_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    s = load_shape(str(tmp_path))
    assert (s.hidden, s.experts, s.top_k) == (1024, 8, 2)


def test_hardware_toml_round_trip_and_base(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(hardware_toml(PRESETS["h100-sxm"]))
    assert load_hardware(str(path)) == PRESETS["h100-sxm"]
    path.write_text('base = "H100-SXM"\nname = "mine"\nmem_bytes = 1e9\n')
    mine = load_hardware(str(path))
    assert (mine.name, mine.mem_bytes, mine.flops) == ("mine", 1e9, PRESETS["h100-sxm"].flops)
    path.write_text('base = "H100-SXM"\nflop = 1\n')
    with pytest.raises(ValueError, match="unknown key"):
        load_hardware(str(path))


def _fake_calibration(
    tmp_path: Path,
    shape,
    hw: Hardware,
    context: float,
    run: str = "bench",
    layout: Layout | None = None,
    levels: tuple[int, ...] = (1, 4, 16),
    exchange_s: float | None = None,
    send_s: float = 0.0,
) -> Path:
    """The files afd plan --calibrate's measurements write, from the model itself: the
    profile of a 1A1F ``layout`` (``run``: ``bench``, the turn-taking one, or
    ``bench-pinned``, one core per role; ``exchange_s``: the exchange's fixed cost instead
    of the placement's, for ``bench-crowded``; ``send_s``: the part of it the attention
    spends sending, beyond one link transfer) and the copy bandwidth."""
    profile = {}
    for b in levels:
        p = predict(shape, hw, layout or Layout(), Workload(batch=b, context=context))
        place = p.placement
        assert place is not None
        n = shape.layers
        speed = 1 + hw.attention_thread_eff * (place.attention_cores - 1)
        head = max(
            2.0 * b * shape.vocab * shape.hidden / hw.flops,
            shape.vocab * shape.hidden * shape.weight_bytes / (hw.mem_bw * hw.bw_eff),
        )
        step_s, step_token_s = hw.step_figures(place.server_cores > 1)
        fixed = hw.exchange_fixed_s(place.shared) if exchange_s is None else exchange_s
        wait = p.ffn_s + 2 * p.transfer_s + fixed
        send = send_s + p.transfer_s if send_s else 0.0
        profile[str(b)] = {
            "processes": [
                {
                    "role": "attention",
                    "steps": 100,
                    "exchanges_per_step": n,
                    "tokens_first_layer_median": b,
                    "ms_per_step": {
                        "attention": p.attention_s * n * 1e3,
                        "send": send * n * 1e3,
                        "wait": (wait - send) * n * 1e3,
                        "step_gap": (step_s + step_token_s * b + head / speed) * 1e3,
                    },
                },
                {"role": "ffn", "steps": 100, "ms_per_step": {"compute": p.ffn_s * n * 1e3}},
            ]
        }
    bench = tmp_path / run
    bench.mkdir()
    report = {"settings": {"usable_cpus": "0-1"}, "profile": {"runs": {"1": {"levels": profile}}}}
    (bench / "bench.json").write_text(json.dumps(report))
    (tmp_path / "memory.json").write_text(json.dumps({"copy_bw_per_core": hw.mem_bw}))
    return tmp_path


def _known_cpu(**figures: float) -> Hardware:
    """The CPU preset with the known figures the calibration tests fit back, plus
    ``figures``."""
    return dataclasses.replace(
        PRESETS["cpu"],
        flops=40e9,
        mem_bw=12e9,
        bw_eff=0.5,
        attention_flops_eff=1.0,
        ffn_flops_eff=1.0,
        attention_layer_s=0.4e-3,
        ffn_layer_s=0.6e-3,
        step_s=5e-3,
        step_token_s=0.1e-3,
        **figures,
    )


def test_calibration_fit_recovers_known_figures(tmp_path):
    shape = shape_from_config(BENCH)
    truth = _known_cpu(exchange_s=0.3e-3)
    hw, _points = fit(shape, _fake_calibration(tmp_path, shape, truth, 48.0), context=48.0)
    assert hw.cores == 2
    assert hw.bw_eff == pytest.approx(0.5)
    assert hw.ffn_layer_s == pytest.approx(0.6e-3, rel=0.1)
    assert hw.attention_layer_s == pytest.approx(0.4e-3, rel=0.1)
    assert hw.exchange_s == pytest.approx(0.3e-3, rel=0.05)
    assert hw.step_s == pytest.approx(5e-3, rel=0.05)
    for b in (2, 8, 32):
        want = predict(shape, truth, Layout(), Workload(b, 48.0)).tpot_s
        assert predict(shape, hw, Layout(), Workload(b, 48.0)).tpot_s == pytest.approx(
            want, rel=0.05
        )


def test_a_repeated_calibration_fits_the_median_of_its_repeats(tmp_path):
    """Three repeats, the first one disturbed (half the FLOP rate, three times the
    exchange): the fit of the three is the undisturbed figures (the median per level; a
    mean, or the first repeat alone, would not be), the fit of the disturbed repeat alone
    is not."""
    shape = shape_from_config(BENCH)
    truth = _known_cpu(exchange_s=0.3e-3)
    slow = dataclasses.replace(truth, flops=20e9, exchange_s=0.9e-3)
    for k, hw in ((1, slow), (2, truth), (3, truth)):
        (tmp_path / f"rep-{k}").mkdir()
        _fake_calibration(tmp_path / f"rep-{k}", shape, hw, 48.0)
    assert [p.name for p in repeat_dirs(tmp_path)] == ["rep-1", "rep-2", "rep-3"]
    hw, points = fit(shape, tmp_path, context=48.0)
    assert points["repeats"] == ["rep-1", "rep-2", "rep-3"]
    assert "median of 3 repeats" in hw.source
    assert hw.exchange_s == pytest.approx(0.3e-3, rel=0.05)
    alone, _ = fit(shape, tmp_path / "rep-1", context=48.0)
    assert alone.exchange_s == pytest.approx(0.9e-3, rel=0.05)
    for b in (2, 8, 32):
        want = predict(shape, truth, Layout(), Workload(b, 48.0)).tpot_s
        got = predict(shape, hw, Layout(), Workload(b, 48.0)).tpot_s
        assert got == pytest.approx(want, rel=0.05)
        assert predict(shape, alone, Layout(), Workload(b, 48.0)).tpot_s > want * 1.2


def test_repeat_dirs_order_and_a_single_run(tmp_path):
    assert repeat_dirs(tmp_path) == [tmp_path]
    for name in ("rep-10", "rep-2", "rep-1", "rep-x", "bench"):
        (tmp_path / name).mkdir()
    assert [p.name for p in repeat_dirs(tmp_path)] == ["rep-1", "rep-2", "rep-10"]


def test_cli_refuses_a_calibration_repeat_below_one(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(BENCH))
    code = main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--calibrate",
            "--calibration-repeat",
            "0",
            "--calibration-dir",
            str(tmp_path / "cal"),
        ]
    )
    assert code == 2
    assert "--calibration-repeat must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "cal").exists()


def test_calibration_on_both_placements_recovers_the_cpu_terms(tmp_path):
    """A pinned run (one core per role) gives the per-core figures, the turn-taking run
    what the second core adds, the exchange on shared CPUs and the step with the
    attention server on both cores, the crowded run (both roles on one CPU) the exchange
    where processes outnumber CPUs; the five validation layouts' TPOT follow."""
    shape = shape_from_config(BENCH)
    truth = _known_cpu(
        exchange_s=0.1e-3,
        shared_exchange_s=0.3e-3,
        spread_step_s=4e-3,
        spread_step_token_s=0.05e-3,
        attention_thread_eff=0.4,
        ffn_thread_eff=0.6,
    )
    levels = (1, 3, 6, 12, 24, 48)
    _fake_calibration(tmp_path, shape, truth, 48.0, "bench", Layout(), levels)
    pinned = Layout(own_cpus=True)
    _fake_calibration(tmp_path, shape, truth, 48.0, "bench-pinned", pinned, levels)
    _fake_calibration(tmp_path, shape, truth, 48.0, "bench-crowded", pinned, levels, 1.5e-3, 0.4e-3)
    truth = dataclasses.replace(truth, crowded_exchange_s=1.5e-3, crowded_send_s=0.4e-3)
    hw, points = fit(shape, tmp_path, context=48.0)
    assert points["per_core_run"] == "bench-pinned"
    assert hw.attention_thread_eff == pytest.approx(0.4, abs=0.02)
    assert hw.ffn_thread_eff == pytest.approx(0.6, abs=0.02)
    assert hw.exchange_s == pytest.approx(0.1e-3, rel=0.05)
    assert hw.shared_exchange_s == pytest.approx(0.3e-3, rel=0.05)
    assert hw.crowded_exchange_s == pytest.approx(1.5e-3, rel=0.05)
    assert hw.crowded_send_s == pytest.approx(0.4e-3, rel=0.05)
    assert hw.step_s == pytest.approx(5e-3, rel=0.02)
    assert hw.spread_step_s == pytest.approx(4e-3, rel=0.02)
    assert hw.spread_step_token_s == pytest.approx(0.05e-3, rel=0.05)
    for layout in (
        Layout(),
        Layout(micro_batches=2),
        Layout(2, 1, 1),
        Layout(1, 2, 1),
        Layout(1, 1, 2, True),
    ):
        for c in (8, 32):
            w = Workload(c / layout.num_attention, 48.0)
            want = predict(shape, truth, layout, w).tpot_s
            assert predict(shape, hw, layout, w).tpot_s == pytest.approx(want, rel=0.02)


def test_cpu_placement_is_the_launchers():
    """On 2 CPUs: 1A1F m=1 takes turns on both, m=2 splits them, Attention TP2 + 1 FFN
    shares them round robin (afd.launch.placement.plan_cpus), 2A1F and EP2 are left to
    vLLM, which binds every attention worker to CPU 0 and gives each FFN rank one
    unbound thread."""
    from afd.launch import DeploymentSpec
    from afd.launch.placement import plan_cpus

    cases = {
        Layout(): (2, 2, True, 2),
        Layout(micro_batches=2): (1, 1, False, 1),
        Layout(own_cpus=True): (1, 1, False, 1),
        Layout(1, 2, 1): (1, 1, True, 2),
        Layout(2, 1, 1): (0.5, 1, True, 2),
        Layout(1, 1, 2, True): (1, 1, True, 2),
    }
    for layout, want in cases.items():
        p = cpu_placement(2, layout)
        assert (p.attention_cores, p.ffn_cores, p.shared, p.server_cores) == want, layout
        # three role processes on two CPUs: crowded; two (taking turns or split): not
        assert p.crowded == (layout.processes > 2), layout
    for layout, kw in (
        (Layout(micro_batches=2), {}),
        (Layout(1, 2, 1), {"attention_tensor_parallel_size": 2}),
    ):
        spec = DeploymentSpec(model="/m", afd={"num_micro_batches": layout.micro_batches}, **kw)
        planned, _ = plan_cpus(spec, [], [0, 1])
        assert cpu_placement(2, layout).text == ", ".join(f"{k}={v}" for k, v in planned.items())
    for kw in ({"num_attention": 2}, {"num_ffn": 2, "ffn_expert_parallel": True}):
        assert plan_cpus(DeploymentSpec(model="/m", **kw), [], [0, 1])[0] == {}
    # four CPUs: 2A1F gets one each (attention 0|1, FFN 2-3)
    p = cpu_placement(4, Layout(2, 1, 1))
    assert (p.attention_cores, p.ffn_cores, p.shared) == (1, 2, False)


def _hand_cpu(**figures: float) -> Hardware:
    """A 2-core CPU host with round hand-computable figures (ROUND's rates; blocks' fixed
    times 1 and 2 ms; exchange 0.1 ms, 0.5 ms on shared CPUs), plus ``figures``."""
    base: dict[str, Any] = {
        "kind": "cpu",
        "cores": 2,
        "attention_layer_s": 1e-3,
        "ffn_layer_s": 2e-3,
        "exchange_s": 1e-4,
        "shared_exchange_s": 5e-4,
    }
    return dataclasses.replace(ROUND, **{**base, **figures})


def _exchange_part(p: Prediction) -> float:
    """What a round-trip-bound MoE layer spends beyond both blocks and two transfers."""
    return p.layer_s - (p.attention_s + p.ffn_s + 2 * p.transfer_s)


def test_hand_computed_cpu_threads_and_shared_exchange():
    """A block on e cores: its fixed time + its one-core variable time / (1 + eff (e - 1));
    two processes on one CPU: both stretched by 2. The exchange costs
    shared_exchange_s where role processes share CPUs, exchange_s where they do not."""
    s = shape_from_config(SMALL)
    cpu = _hand_cpu(attention_thread_eff=0.5, ffn_thread_eff=0.25)
    w = Workload(batch=1, context=0)
    turns = predict(s, cpu, Layout(), w)
    pinned = predict(s, cpu, Layout(own_cpus=True), w)
    # the one-token attention reads 8.39 MB at 1 GB/s (test_hand_computed_one_token_1a1f)
    assert pinned.attention_s == pytest.approx(1e-3 + 8.388608e-3)
    assert turns.attention_s == pytest.approx(1e-3 + 8.388608e-3 / 1.5)
    assert turns.ffn_s == pytest.approx(2e-3 + 6.30784e-3 / 1.25)
    assert _exchange_part(pinned) == pytest.approx(1e-4)
    assert _exchange_part(turns) == pytest.approx(5e-4)
    # 2A1F on 2 CPUs: both attention workers on CPU 0 take twice as long; three
    # processes on two CPUs pay the crowded exchange cost where the figures have one
    two = predict(s, cpu, Layout(2, 1, 1), w)
    assert two.attention_s == pytest.approx(2 * (1e-3 + 8.388608e-3))
    assert _exchange_part(two) == pytest.approx(5e-4)
    crowded = predict(s, dataclasses.replace(cpu, crowded_exchange_s=2e-3), Layout(2, 1, 1), w)
    assert crowded.layer_s - two.layer_s == pytest.approx(2e-3 - 5e-4)


def test_ffn_ep_on_shared_cpus_pays_for_each_further_peer():
    """Under FFN EP an attention rank exchanges with each FFN rank's plane in turn: on
    CPUs the processes share (EP2 on 2 CPUs: crowded) each further FFN rank adds the
    attention's own side of an exchange (crowded_send_s), or the whole fixed cost again
    where that is not measured; where every process has CPUs of its own (4 CPUs), once."""
    s = shape_from_config(SMALL)
    cpu = _hand_cpu(crowded_exchange_s=2e-3)
    w = Workload(batch=1, context=0)
    ep2 = predict(s, cpu, Layout(1, 1, 2, True), w)
    assert ep2.placement is not None and ep2.placement.crowded
    assert ep2.bound == "exchange"
    assert _exchange_part(ep2) == pytest.approx(2 * 2e-3)
    sent = predict(s, dataclasses.replace(cpu, crowded_send_s=3e-4), Layout(1, 1, 2, True), w)
    assert _exchange_part(sent) == pytest.approx(2e-3 + 3e-4)
    # without EP the one FFN peer pays it once (2A1F, also crowded)
    assert _exchange_part(predict(s, cpu, Layout(2, 1, 1), w)) == pytest.approx(2e-3)
    # three processes on four CPUs: split_cpus gives each its own, nothing shared
    roomy = predict(s, dataclasses.replace(cpu, cores=4), Layout(1, 1, 2, True), w)
    assert roomy.placement is not None and not roomy.placement.shared
    assert roomy.bound == "exchange"
    assert _exchange_part(roomy) == pytest.approx(1e-4)


def test_step_outside_the_layers_depends_on_the_servers_cores():
    """The step outside the layers: step_* with the attention server on one CPU (1A1F
    m=2 on 2 CPUs), spread_step_* with it on both (2A1F: left to vLLM, unbound)."""
    s = shape_from_config(SMALL)
    cpu = dataclasses.replace(
        ROUND, kind="cpu", cores=2, step_s=5e-3, step_token_s=1e-4, spread_step_s=3e-3
    )
    plain = dataclasses.replace(cpu, spread_step_s=-1.0)
    w = Workload(batch=10, context=0)
    for layout, gain in ((Layout(micro_batches=2), 0.0), (Layout(2, 1, 1), 5e-3 + 10e-4 - 3e-3)):
        got = predict(s, plain, layout, w).tpot_s - predict(s, cpu, layout, w).tpot_s
        assert got == pytest.approx(gain, abs=1e-12)
