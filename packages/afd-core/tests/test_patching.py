"""afd_core.patching.scoped_globals: the primitive behind role-aware construction."""

from __future__ import annotations

import types

import pytest

from afd_core.patching import PatchDriftError, referenced_globals, scoped_globals


def test_missing_name_fails_with_the_module_and_symbol() -> None:
    mod = types.ModuleType("fake_upstream")
    mod.Present = 1  # type: ignore[attr-defined]
    expected = r"fake_upstream no longer defines \['Gone'\]"
    with (
        pytest.raises(PatchDriftError, match=expected),
        scoped_globals(mod, {"Present": 2, "Gone": 3}),
    ):
        pass
    assert mod.Present == 1  # type: ignore[attr-defined]


def test_names_are_replaced_only_inside_the_block() -> None:
    mod = types.ModuleType("fake_upstream")
    mod.Factory = "native"  # type: ignore[attr-defined]

    def build() -> str:
        return mod.Factory  # type: ignore[attr-defined,no-any-return]

    with scoped_globals(mod, {"Factory": "afd"}):
        assert build() == "afd"
    assert build() == "native"


def test_referenced_globals_sees_names_in_nested_code() -> None:
    def outer() -> object:
        def inner() -> object:
            return SomeUpstreamName  # type: ignore[name-defined]  # noqa: F821

        return inner

    assert "SomeUpstreamName" in referenced_globals(outer)


def test_referenced_globals_follows_decorator_closures() -> None:
    def original() -> object:
        return UpstreamOnlyInOriginal  # type: ignore[name-defined]  # noqa: F821

    def decorate(f: object) -> object:
        def wrapper() -> object:
            return f()  # type: ignore[operator]

        return wrapper

    wrapped = decorate(original)
    assert "UpstreamOnlyInOriginal" in referenced_globals(wrapped)  # type: ignore[arg-type]
