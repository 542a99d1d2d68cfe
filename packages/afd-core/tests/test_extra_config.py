"""connector_extra_config is checked in one way: a connector's ``extra_schema``."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar

import pytest

from afd_core.connector import AFDConnector, ExtraKey
from afd_core.errors import AFDConfigError
from afd_core.testing.null import NullConnector


class _Schema(NullConnector):
    name: ClassVar[str] = "SchemaConnector"
    extra_schema = MappingProxyType(
        {
            "max_num_tokens": ExtraKey.integer(default=64),
            "spin_us": ExtraKey.integer(minimum=0, default=0),
            "dtype": ExtraKey.one_of(("bfloat16", "float32")),
            "pool": ExtraKey.flag(),
            "names": ExtraKey.text_mapping("op -> name"),
        }
    )


class _Wrapper(NullConnector):
    extra_schema = None


def test_declared_keys_get_their_defaults() -> None:
    assert _Schema.validate_extra_config({"dtype": "float32"}) == {
        "max_num_tokens": 64,
        "spin_us": 0,
        "dtype": "float32",
        "pool": False,
        "names": None,
    }


def test_an_unknown_key_names_it_the_closest_key_and_every_allowed_key_with_its_type() -> None:
    with pytest.raises(AFDConfigError) as info:
        _Schema.validate_extra_config({"max_num_token": 3})
    text = str(info.value)
    assert "connector_extra_config of SchemaConnector: unknown keys ['max_num_token']" in text
    assert "did you mean 'max_num_tokens'?" in text
    assert "allowed keys: dtype: one of bfloat16, float32; max_num_tokens: an int >= 1;" in text


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_num_tokens", 0, "an int >= 1"),
        ("max_num_tokens", True, "an int >= 1"),
        ("spin_us", -1, "an int >= 0"),
        ("dtype", "int8", "one of bfloat16, float32"),
        ("pool", "yes", "true or false"),
        ("names", {"a": 1}, "a mapping of op -> name (strings)"),
    ],
)
def test_a_bad_value_names_the_key_what_it_takes_and_the_allowed_keys(
    key: str, value: Any, expected: str
) -> None:
    with pytest.raises(AFDConfigError) as info:
        _Schema.validate_extra_config({key: value})
    text = str(info.value)
    assert text.startswith(
        f"connector_extra_config[{key!r}] of SchemaConnector: expected {expected}, got {value!r}"
    )
    assert "(allowed keys: dtype:" in text


def test_a_connector_without_keys_takes_none_and_a_wrapper_passes_the_mapping_on() -> None:
    assert AFDConnector.extra_schema == {}
    with pytest.raises(AFDConfigError, match="takes no extra options"):
        NullConnector.validate_extra_config({"x": 1})
    assert _Wrapper.validate_extra_config({"x": 1}) == {"x": 1}
