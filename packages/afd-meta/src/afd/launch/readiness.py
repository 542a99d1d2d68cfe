"""How the launcher tells that a role process is ready, one object per kind of role.

Every role is ready once ``GET <health URL>/health`` answers 200: the FFN server's own
status server (:mod:`afd.runtime.health`) turns 200 once its attention peers are connected and
it serves; the attention server's (vLLM's API server) once vLLM's engine is up; the
native baseline's likewise. The FFN server also logs :data:`afd.runtime.ffn_server.READY_MARKER`
when its model is loaded, before its peers connect: that line is not readiness.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from afd.runtime.ffn_server import READY_MARKER
from afd_core.roles import AFDRole

__all__ = [
    "ATTENTION",
    "FFN",
    "NATIVE",
    "PREFILL",
    "PROXY",
    "AttentionReadiness",
    "FFNReadiness",
    "NativeReadiness",
    "RoleReadiness",
    "http_health",
    "readiness_of",
]

NATIVE = "native"
"""The role name of the native baseline (a plain vLLM server, no AFD role)."""
PREFILL = "prefill"
"""The role name of a ``[prefill]`` spec's prefill instance (a plain vLLM server)."""
PROXY = "proxy"
"""The role name of a ``[prefill]`` spec's prefill -> decode proxy (the deployment's URL)."""


def http_health(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    """``(status is 200, first line of the answer)``; the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200, r.read(200).decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read(200).decode(errors='replace').strip()}".strip()
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, f"no answer ({getattr(e, 'reason', e)})"


@dataclass(frozen=True)
class RoleReadiness:
    """What ``ready`` means for one kind of role process."""

    role: AFDRole | None = None
    """The AFD role; None for the native baseline and a ``[prefill]`` spec's processes."""
    kind: str = NATIVE
    """The name of a process kind that is no AFD role (``native``, ``prefill``, ``proxy``)."""
    marker: str | None = None
    """The line the role logs when it has loaded its model (not readiness: see above)."""
    health_path: str = "/health"

    @property
    def name(self) -> str:
        return self.kind if self.role is None else self.role.value

    def health_url(self, base_url: str) -> str:
        return f"{base_url}{self.health_path}"

    def probe(self, base_url: str) -> tuple[bool, str]:
        """``(ready, what its health endpoint answered)``."""
        return http_health(self.health_url(base_url))

    def endpoint_lines(self, name: str, base_url: str | None) -> list[str]:
        """What ``afd launch`` prints of this role besides the OpenAI endpoints."""
        return []


@dataclass(frozen=True)
class FFNReadiness(RoleReadiness):
    """An FFN server: ready when its status server's ``/health`` answers 200 (its
    attention peers are connected and it serves), which also serves ``/metrics``."""

    role: AFDRole | None = AFDRole.FFN
    marker: str | None = READY_MARKER

    def endpoint_lines(self, name: str, base_url: str | None) -> list[str]:
        return [f"  {base_url}/health, {base_url}/metrics  ({name})"]


@dataclass(frozen=True)
class AttentionReadiness(RoleReadiness):
    """The attention server (vLLM's API server): ready when vLLM's ``/health`` answers 200."""

    role: AFDRole | None = AFDRole.ATTENTION


@dataclass(frozen=True)
class NativeReadiness(RoleReadiness):
    """The native baseline (plain vLLM API server): ready when its ``/health`` answers 200."""

    role: AFDRole | None = None


@dataclass(frozen=True)
class PrefillReadiness(RoleReadiness):
    """A ``[prefill]`` spec's prefill instance (plain vLLM API server, ``kv_producer``):
    ready when its ``/health`` answers 200."""

    kind: str = PREFILL

    def endpoint_lines(self, name: str, base_url: str | None) -> list[str]:
        return [f"  {base_url}/metrics  ({name}: prompt tokens it computed)"]


@dataclass(frozen=True)
class ProxyReadiness(RoleReadiness):
    """A ``[prefill]`` spec's proxy (:mod:`afd.launch.pd_proxy`): ready when its
    ``/health`` answers 200, which it does once the prefill and decode servers do."""

    kind: str = PROXY


FFN = FFNReadiness()
ATTENTION = AttentionReadiness()
_BY_NAME: dict[str, RoleReadiness] = {
    r.name: r for r in (FFN, ATTENTION, NativeReadiness(), PrefillReadiness(), ProxyReadiness())
}


def readiness_of(role: str) -> RoleReadiness:
    """The readiness of a role process by its role (``AFDRole`` or ``"native"``)."""
    try:
        return _BY_NAME[str(role)]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(_BY_NAME)}") from None
