"""AFDConfig parsing and validation: the user-facing contract of additional_config['afd']."""

from __future__ import annotations

import json
import math
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_core.config import (
    CONFIG_ALIASES,
    AFDConfig,
    AFDRole,
    RoutingPayload,
    additional_config_json,
)
from afd_core.errors import AFDConfigError

FIELDS = AFDConfig.field_names()


def _parse_error(mapping: Any) -> str:
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.parse(mapping)
    return str(info.value)


# (id, section, substrings the one-line message must contain: field, given value, allowed)
MALFORMED: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("role_unknown", {"role": "worker"}, ("afd.role", "'worker' (str)", "'attention' or 'ffn'")),
    ("role_int", {"role": 1}, ("afd.role", "1 (int)", "'attention' or 'ffn'")),
    ("role_missing", {"port": 1}, ("afd.role", "required", "got nothing")),
    ("port_str", {"role": "ffn", "port": "abc"}, ("afd.port", "'abc' (str)", "1..65535")),
    ("port_zero", {"role": "ffn", "port": 0}, ("afd.port", "0 (int)", "1..65535")),
    ("port_too_big", {"role": "ffn", "port": 70000}, ("afd.port", "70000 (int)", "1..65535")),
    ("port_bool", {"role": "ffn", "port": True}, ("afd.port", "True (bool)", "an int")),
    ("port_float", {"role": "ffn", "port": 8.0}, ("afd.port", "8.0 (float)", "an int")),
    (
        "attention_ranks_zero",
        {"role": "ffn", "num_attention_ranks": 0},
        ("afd.num_attention_ranks", "0 (int)", ">= 1"),
    ),
    (
        "ffn_ranks_negative",
        {"role": "ffn", "num_ffn_ranks": -1},
        ("afd.num_ffn_ranks", "-1 (int)", ">= 1"),
    ),
    (
        "ffn_ranks_str",
        {"role": "ffn", "num_ffn_ranks": "2"},
        ("afd.num_ffn_ranks", "'2' (str)", ">= 1"),
    ),
    (
        "rank_too_big",
        {"role": "attention", "num_attention_ranks": 2, "rank": 2},
        ("afd.rank", "2 (int)", "0..1", "num_attention_ranks=2"),
    ),
    ("rank_negative", {"role": "ffn", "rank": -1}, ("afd.rank", "-1 (int)", "0..0")),
    (
        "gate_str",
        {"role": "ffn", "compute_gate_on_attention": "yes"},
        ("afd.compute_gate_on_attention", "'yes' (str)", "a bool"),
    ),
    (
        "routing_unknown",
        {"role": "ffn", "compute_gate_on_attention": True, "routing_payload": "softmax"},
        ("afd.routing_payload", "'softmax' (str)", "'topk' or 'router_logits'"),
    ),
    (
        "router_logits_gate_off",
        {"role": "ffn", "routing_payload": "router_logits"},
        ("afd.routing_payload", "'router_logits'", "compute_gate_on_attention=true"),
    ),
    (
        "micro_batches_zero",
        {"role": "ffn", "num_micro_batches": 0},
        ("afd.num_micro_batches", "0 (int)", ">= 1"),
    ),
    (
        "micro_batch_min_tokens_negative",
        {"role": "attention", "micro_batch_min_tokens": -1},
        ("afd.micro_batch_min_tokens", "-1 (int)", ">= 0"),
    ),
    (
        "micro_batch_min_tokens_float",
        {"role": "attention", "micro_batch_min_tokens": 1.5},
        ("afd.micro_batch_min_tokens", "1.5 (float)"),
    ),
    (
        "connect_timeout_zero",
        {"role": "ffn", "connect_timeout_s": 0},
        ("afd.connect_timeout_s", "0 (int)", "> 0"),
    ),
    (
        "transfer_timeout_inf",
        {"role": "ffn", "transfer_timeout_s": math.inf},
        ("afd.transfer_timeout_s", "inf (float)", "finite"),
    ),
    (
        "transfer_timeout_nan",
        {"role": "ffn", "transfer_timeout_s": math.nan},
        ("afd.transfer_timeout_s", "nan (float)", "finite"),
    ),
    (
        "transfer_timeout_str",
        {"role": "ffn", "transfer_timeout_s": "10"},
        ("afd.transfer_timeout_s", "'10' (str)", "seconds"),
    ),
    ("host_empty", {"role": "ffn", "host": ""}, ("afd.host", "'' (str)", "non-empty string")),
    ("host_int", {"role": "ffn", "host": 123}, ("afd.host", "123 (int)", "non-empty string")),
    (
        "connector_blank",
        {"role": "ffn", "connector": "  "},
        ("afd.connector", "'  ' (str)", "non-empty string"),
    ),
    (
        "connector_none",
        {"role": "ffn", "connector": None},
        ("afd.connector", "None (NoneType)", "non-empty string"),
    ),
    (
        "extra_not_mapping",
        {"role": "ffn", "connector_extra_config": [1, 2]},
        ("afd.connector_extra_config", "[1, 2] (list)", "a mapping"),
    ),
    (
        "extra_int_key",
        {"role": "ffn", "connector_extra_config": {1: "a"}},
        ("afd.connector_extra_config", "1 (int)", "string keys"),
    ),
    ("unknown_key", {"role": "ffn", "prot": 3}, ("afd:", "'prot'", "did you mean 'port'", "port")),
    (
        "alias_and_canonical",
        {"role": "ffn", "port": 1, "afd_port": 2},
        ("afd.port", "'port' and 'afd_port'", "keep only 'port'"),
    ),
    ("alias_bad_value", {"role": "ffn", "afd_port": "x"}, ("afd.port", "'x' (str)", "1..65535")),
    (
        "alias_stages_zero",
        {"role": "ffn", "num_afd_stages": 0},
        ("afd.num_micro_batches", "0 (int)", ">= 1"),
    ),
    ("section_not_mapping", ["role"], ("afd:", "['role'] (list)", "a mapping")),
    (
        "transfer_dtype_unknown",
        {"role": "ffn", "transfer_dtype": "fp4"},
        ("afd.transfer_dtype", "'fp4' (str)", "'model', 'fp8', 'mxfp8', 'int8'"),
    ),
    (
        "transfer_dtype_return_not_str",
        {"role": "ffn", "transfer_dtype_return": 8},
        ("afd.transfer_dtype_return", "8 (int)", "'mxfp8'"),
    ),
]


@pytest.mark.parametrize(
    ("section", "needles"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_config_gives_one_line_error_naming_field_value_and_allowed(
    section: Any, needles: tuple[str, ...]
) -> None:
    message = _parse_error(section)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_at_least_twenty_malformed_configurations_are_covered() -> None:
    assert len(MALFORMED) >= 20


def test_upstream_aliases_map_to_canonical_fields() -> None:
    config = AFDConfig.parse(
        {
            "afd_role": "ffn",
            "afd_connector": "X",
            "afd_host": "h",
            "afd_port": 1234,
            "num_afd_stages": 2,
            "afd_extra_config": {"a": 1},
        }
    )
    assert config.role is AFDRole.FFN
    assert (config.connector, config.host, config.port) == ("X", "h", 1234)
    assert config.num_micro_batches == 2
    assert dict(config.connector_extra_config) == {"a": 1}
    assert set(CONFIG_ALIASES.values()) <= set(FIELDS)


def test_extra_config_is_read_only_copy() -> None:
    extra = {"a": 1}
    config = AFDConfig.parse({"role": "ffn", "connector_extra_config": extra})
    extra["a"] = 2
    assert config.connector_extra_config["a"] == 1
    assert isinstance(config.connector_extra_config, MappingProxyType)
    with pytest.raises(TypeError):
        config.connector_extra_config["a"] = 3  # type: ignore[index]


def test_config_is_frozen_and_direct_construction_is_validated() -> None:
    config = AFDConfig(role=AFDRole.ATTENTION)
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(AFDConfigError, match=r"afd\.port"):
        AFDConfig(role=AFDRole.ATTENTION, port=0)
    assert (
        AFDConfig(
            role="ffn", routing_payload="router_logits", compute_gate_on_attention=True
        ).routing_payload
        is RoutingPayload.ROUTER_LOGITS
    )  # type: ignore[arg-type]


def test_from_additional_config_reads_afd_section() -> None:
    config = AFDConfig.from_additional_config({"afd": {"role": "ffn", "port": 4000}, "other": 1})
    assert (config.role, config.port) == (AFDRole.FFN, 4000)


def test_from_additional_config_role_argument_fills_missing_role() -> None:
    config = AFDConfig.from_additional_config({"afd": {"port": 4000}}, role="attention")
    assert config.role is AFDRole.ATTENTION
    assert AFDConfig.from_additional_config(None, role=AFDRole.FFN).role is AFDRole.FFN
    assert (
        AFDConfig.from_additional_config({"afd": {"afd_role": "ffn"}}, role="ffn").role
        is AFDRole.FFN
    )


def test_from_additional_config_conflicting_role_is_an_error() -> None:
    with pytest.raises(AFDConfigError, match=r"runs as 'ffn'.*'attention'"):
        AFDConfig.from_additional_config({"afd": {"role": "attention"}}, role="ffn")


def test_from_additional_config_names_the_option_that_gave_the_role() -> None:
    with pytest.raises(AFDConfigError, match=r"^--role ffn conflicts with afd.role='attention'"):
        AFDConfig.from_additional_config(
            {"afd": {"afd_role": "attention"}}, role="ffn", role_from="--role"
        )


def test_additional_config_json_is_what_the_process_parses_back() -> None:
    import json

    from afd_core.config import additional_config_json, afd_config_of

    config = AFDConfig.parse({"role": "ffn", "num_afd_stages": 2, "rank": 0, "port": 4000})
    blob = additional_config_json(config, {"other": 1, "afd": {"stale": True}})
    data = json.loads(blob)
    # canonical keys, the role and what differs from the defaults; other keys kept
    assert data == {
        "other": 1,
        "afd": {"role": "ffn", "num_micro_batches": 2, "rank": 0, "port": 4000},
    }
    assert AFDConfig.from_additional_config(data) == config

    class _VllmConfig:
        additional_config = data

    assert afd_config_of(_VllmConfig()) == config


def test_from_additional_config_without_section_or_role_explains_the_flag() -> None:
    with pytest.raises(AFDConfigError, match="--additional-config") as info:
        AFDConfig.from_additional_config({"x": 1})
    assert "\n" not in str(info.value)
    with pytest.raises(AFDConfigError, match="expected a mapping"):
        AFDConfig.from_additional_config("afd")  # type: ignore[arg-type]


def test_compute_hash_tracks_graph_fields_only() -> None:
    base = AFDConfig(role=AFDRole.ATTENTION)
    assert base.compute_hash() == AFDConfig(role=AFDRole.ATTENTION).compute_hash()
    assert base.compute_hash() == AFDConfig(role=AFDRole.ATTENTION, port=1, host="x").compute_hash()
    assert base.compute_hash() != AFDConfig(role=AFDRole.FFN).compute_hash()
    assert (
        base.compute_hash() != AFDConfig(role=AFDRole.ATTENTION, num_micro_batches=2).compute_hash()
    )
    gate = AFDConfig(role=AFDRole.ATTENTION, compute_gate_on_attention=True)
    assert base.compute_hash() != gate.compute_hash()
    for key in ("transfer_dtype", "transfer_dtype_return"):
        quantized = AFDConfig(role=AFDRole.ATTENTION, **{key: "fp8"})
        assert base.compute_hash() != quantized.compute_hash()
    assert len(base.compute_hash()) == 16


def test_transfer_dtypes_are_normalised_and_reach_the_role_process() -> None:
    config = AFDConfig.from_additional_config(
        {"afd": {"role": "attention", "transfer_dtype": " FP8 ", "transfer_dtype_return": "int8"}}
    )
    assert (config.transfer_dtype, config.transfer_dtype_return) == ("fp8", "int8")
    section = json.loads(additional_config_json(config))["afd"]
    assert section["transfer_dtype"] == "fp8" and section["transfer_dtype_return"] == "int8"
    assert AFDConfig.parse(section) == config
    # The default (model) is not written: the process reads the default back.
    assert "transfer_dtype" not in AFDConfig(role=AFDRole.FFN).to_section()


def test_topology_property_matches_rank_counts() -> None:
    topo = AFDConfig(role=AFDRole.FFN, num_attention_ranks=3, num_ffn_ranks=2).topology
    assert (topo.num_attention_ranks, topo.num_ffn_ranks) == (3, 2)


# -- properties ------------------------------------------------------------------------

_names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20
)
_timeouts = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def valid_sections(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["attention", "ffn"]))
    a = draw(st.integers(1, 64))
    f = draw(st.integers(1, 64))
    size = a if role == "attention" else f
    gate = draw(st.booleans())
    section: dict[str, Any] = {
        "role": role,
        "num_attention_ranks": a,
        "num_ffn_ranks": f,
        "rank": draw(st.none() | st.integers(0, size - 1)),
        "compute_gate_on_attention": gate,
        "routing_payload": draw(st.sampled_from(["topk", "router_logits"] if gate else ["topk"])),
        "connector": draw(_names),
        "host": draw(_names),
        "port": draw(st.integers(1, 65535)),
        "num_micro_batches": draw(st.integers(1, 8)),
        "micro_batch_min_tokens": draw(st.integers(0, 4096)),
        "transfer_dtype": draw(st.sampled_from(["model", "fp8", "mxfp8", "int8"])),
        "transfer_dtype_return": draw(st.sampled_from(["model", "fp8", "mxfp8", "int8"])),
        "connect_timeout_s": draw(_timeouts),
        "transfer_timeout_s": draw(_timeouts),
        "connector_extra_config": draw(
            st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3)
        ),
    }
    # Any subset of the optional keys may be left out (defaults apply).
    # (Rank counts and the gate stay: rank and routing_payload are checked against them.)
    keep = {"role", "num_attention_ranks", "num_ffn_ranks", "compute_gate_on_attention"}
    optional = [k for k in section if k not in keep]
    drop = draw(st.sets(st.sampled_from(optional)))
    return {k: v for k, v in section.items() if k not in drop}


@settings(max_examples=150, deadline=None)
@given(valid_sections())
def test_valid_configs_round_trip_through_to_dict_and_parse(section: dict[str, Any]) -> None:
    config = AFDConfig.parse(section)
    data = config.to_dict()
    assert set(data) == set(FIELDS)
    again = AFDConfig.parse(data)
    assert again == config
    assert again.to_dict() == data
    assert again.compute_hash() == config.compute_hash()
    for key, value in section.items():
        assert data[key] == value


@settings(max_examples=150, deadline=None)
@given(valid_sections(), st.text(min_size=1, max_size=30), st.integers())
def test_any_unknown_key_is_rejected_with_the_valid_keys(
    section: dict[str, Any], key: str, value: int
) -> None:
    if key in FIELDS or key in CONFIG_ALIASES:
        return
    message = _parse_error({**section, key: value})
    assert "unknown key" in message
    assert repr(key) in message
    assert "valid keys: role, connector" in message
    assert "\n" not in message


def test_equal_configs_hash_equal() -> None:
    one = AFDConfig(role=AFDRole.FFN, connector_extra_config={"x": [1]})
    two = AFDConfig.parse({"role": "ffn", "connector_extra_config": {"x": [1]}})
    assert one == two and hash(one) == hash(two)
    assert len({one, two, AFDConfig(role=AFDRole.ATTENTION)}) == 2


def test_expert_planes_of_an_expert_parallel_ffn_side() -> None:
    attn = AFDConfig(
        role="attention", num_attention_ranks=2, num_ffn_ranks=3, rank=1, port=29000,
        ffn_expert_parallel=True,
    )  # fmt: skip
    planes = [attn.expert_plane(f) for f in range(3)]
    assert [(p.port, p.num_ffn_ranks, p.rank, p.num_attention_ranks) for p in planes] == [
        (29000, 1, 1, 2), (29001, 1, 1, 2), (29002, 1, 1, 2),
    ]  # fmt: skip
    ffn = AFDConfig(role="ffn", num_ffn_ranks=3, rank=2, port=29000, ffn_expert_parallel=True)
    plane = ffn.expert_plane(2)
    assert (plane.port, plane.rank, plane.num_ffn_ranks) == (29002, 0, 1)
    with pytest.raises(AFDConfigError, match="FFN rank 2 asked for the plane of FFN rank 0"):
        ffn.expert_plane(0)
    with pytest.raises(AFDConfigError, match=r"only with afd.ffn_expert_parallel=true"):
        AFDConfig(role="ffn").expert_plane(0)
    with pytest.raises(AFDConfigError, match=r"afd.ffn_expert_parallel: expected a bool"):
        AFDConfig(role="ffn", ffn_expert_parallel="yes")
    with pytest.raises(AFDConfigError, match=r"rendezvous on ports 65535..65536"):
        AFDConfig(role="ffn", num_ffn_ranks=2, port=65535, ffn_expert_parallel=True)


def test_to_section_is_canonical_and_round_trips() -> None:
    config = AFDConfig.parse({"afd_role": "attention", "num_afd_stages": 2, "afd_port": 4000})
    section = config.to_section()
    # canonical keys, only what differs from the defaults (role always)
    assert section == {"role": "attention", "port": 4000, "num_micro_batches": 2}
    assert AFDConfig.parse(section) == config
    assert AFDConfig.parse({"role": "ffn"}).to_section() == {"role": "ffn"}


def test_afd_config_of_parses_each_section_once_per_process() -> None:
    from types import SimpleNamespace

    from afd_core.config import afd_config_of

    def engine(section: object) -> object:
        return SimpleNamespace(additional_config={"afd": section})

    section = {"role": "attention", "num_afd_stages": 2}
    first = afd_config_of(engine(section))
    assert first is not None and first.num_micro_batches == 2
    # another engine config with the same section: the same parsed object
    assert afd_config_of(engine(dict(section))) is first
    assert afd_config_of(engine({"role": "ffn"})) is not first
    assert afd_config_of(SimpleNamespace(additional_config={})) is None
    assert afd_config_of(SimpleNamespace(additional_config=None)) is None
    with pytest.raises(AFDConfigError, match="unknown key 'nope'"):
        afd_config_of(engine({"role": "ffn", "nope": 1}))


def test_afd_plugin_async_key_follows_its_rule() -> None:
    """afd-plugin's ``async`` (alias of its ``async_dp``): a bool, true only with
    CAMAsyncAFDConnector; accepted with that meaning, nothing else changes."""
    base = {"afd_role": "attention", "afd_connector": "CAMAsyncAFDConnector"}
    for key in ("async", "async_dp"):
        for value in (True, False):
            config = AFDConfig.parse({**base, key: value})
            assert config == AFDConfig.parse(base)
    assert AFDConfig.parse({"role": "ffn", "async": False}).connector == "P2pGlooAFDConnector"
    with pytest.raises(
        AFDConfigError,
        match=r"afd\.async: true requires connector "
        r"'CAMAsyncAFDConnector'.*got 'P2pNcclAFDConnector'.*drop 'async'",
    ):
        AFDConfig.parse({"role": "attention", "connector": "P2pNcclAFDConnector", "async": True})
    with pytest.raises(AFDConfigError, match=r"afd\.async_dp: expected a bool"):
        AFDConfig.parse({**base, "async_dp": "yes"})
    with pytest.raises(AFDConfigError, match="given twice, as 'async' and 'async_dp'"):
        AFDConfig.parse({**base, "async": True, "async_dp": True})
