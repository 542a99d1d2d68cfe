"""Connectors by name.

A connector package declares its classes in the entry-point group
``afd.connectors``::

    [project.entry-points."afd.connectors"]
    P2pGlooAFDConnector = "afd_connectors_gpu.p2p:P2pGlooAFDConnector"

so that a third-party package adds a connector without editing afd. Targets
are ``"module:Class"`` strings resolved only when the connector is requested:
listing the available names never imports a connector (nor torch).
:func:`register_connector` adds a name in-process (tests, notebooks).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Mapping

from afd_core.config import AFDConfig
from afd_core.connector import AFDConnector
from afd_core.errors import AFDConfigError, UnknownConnectorError

__all__ = [
    "ENTRY_POINT_GROUP",
    "register_connector",
    "unregister_connector",
    "available_connectors",
    "get_connector_class",
    "create_connector",
]

ENTRY_POINT_GROUP = "afd.connectors"

_lock = threading.RLock()
_registered: dict[str, str | type[AFDConnector]] = {}
_loaded: dict[str, type[AFDConnector]] = {}


def _target_path(target: str | type) -> str:
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


def _entry_points() -> dict[str, list[str]]:
    """Installed ``afd.connectors`` entry points: name -> distinct target strings."""
    found: dict[str, list[str]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        values = found.setdefault(ep.name, [])
        if ep.value not in values:
            values.append(ep.value)
    return found


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise AFDConfigError(
            f"connector name: expected a non-empty string, got {name!r} ({type(name).__name__})"
        )
    return name


def register_connector(name: str, target: str | type[AFDConnector]) -> None:
    """Register ``target`` (a class or ``"module:Class"``) under ``name`` in this process.

    Registering the same target again does nothing; a different target under a
    name already taken (in-process or by an installed entry point) raises.
    """
    name = _check_name(name)
    if isinstance(target, str):
        if ":" not in target:
            raise AFDConfigError(
                f"connector {name!r}: expected a target 'module:Class', got {target!r}"
            )
    elif not (isinstance(target, type) and issubclass(target, AFDConnector)):
        raise AFDConfigError(
            f"connector {name!r}: expected an AFDConnector subclass or 'module:Class', "
            f"got {target!r}"
        )
    path = _target_path(target)
    with _lock:
        existing: list[str] = []
        if name in _registered:
            existing.append(_target_path(_registered[name]))
        existing.extend(_entry_points().get(name, []))
        clash = [e for e in existing if e != path]
        if clash:
            raise AFDConfigError(
                f"connector {name!r} is already registered as {clash[0]!r}; "
                f"refusing to replace it with {path!r} (choose another name)"
            )
        if name in _registered and not isinstance(target, type):
            return
        _registered[name] = target
        if isinstance(target, type):
            _loaded[name] = target


def unregister_connector(name: str) -> None:
    """Forget an in-process registration (entry points stay). Mostly for tests."""
    with _lock:
        _registered.pop(name, None)
        _loaded.pop(name, None)


def available_connectors() -> list[str]:
    """Sorted names of every connector (in-process and installed); imports none of them."""
    with _lock:
        return sorted(set(_registered) | set(_entry_points()))


def _load(name: str, path: str) -> type[AFDConnector]:
    module_name, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name.strip())
        for part in attr.strip().split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise AFDConfigError(
            f"connector {name!r}: could not load {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, AFDConnector)):
        raise AFDConfigError(
            f"connector {name!r}: {path!r} is {obj!r}, expected a subclass of "
            "afd_core.connector.AFDConnector"
        )
    return obj


def get_connector_class(name: str) -> type[AFDConnector]:
    """The connector class registered under ``name``, imported on first use."""
    name = _check_name(name)
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _registered:
            target = _registered[name]
            cls = target if isinstance(target, type) else _load(name, target)
        else:
            eps = _entry_points()
            if name not in eps:
                installed = sorted(set(_registered) | set(eps))
                raise UnknownConnectorError(
                    f"afd.connector: unknown connector {name!r}; installed: "
                    f"{', '.join(installed) or '(none)'} (entry-point group "
                    f"{ENTRY_POINT_GROUP!r}; install the package providing it)"
                )
            if len(eps[name]) > 1:
                raise AFDConfigError(
                    f"connector {name!r} is declared by several installed packages with "
                    f"different targets {eps[name]}; uninstall all but one"
                )
            cls = _load(name, eps[name][0])
        _loaded[name] = cls
        return cls


def create_connector(
    config: AFDConfig, *, rank: int, identity: Mapping[str, str] | None = None
) -> AFDConnector:
    """Instantiate ``config.connector`` for this process (not yet initialised).

    ``identity`` is the deployment fingerprint of what this process loaded
    (:mod:`afd_core.identity`); the connector's handshake compares it across the roles.
    """
    connector = get_connector_class(config.connector)(config, rank=rank)
    if identity is not None:
        connector.identity = dict(identity)
    return connector
