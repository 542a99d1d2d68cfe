"""``additional_config["afd"]``: parsed and validated into a frozen :class:`AFDConfig`.

Users set every AFD option through vLLM's ``--additional-config '{"afd": {...}}'``.
:meth:`AFDConfig.from_additional_config` reads that section, accepts the key
names of the upstream plugin as aliases (``afd_role``, ``afd_port``...), rejects
unknown keys with a "did you mean" hint, and validates every value with a
one-line :class:`~afd_core.errors.AFDConfigError` that names the field, the
value given and what is allowed. The same checks run when an :class:`AFDConfig`
is built directly, so an instance is always valid.

The section is parsed once, at the edge (``afd serve``, ``afd launch``'s spec), and
handed on in canonical keys by one function, :func:`additional_config_json` (the
``--additional-config`` value of a role process); every role process then reads it
through :func:`afd_config_of`, which parses each distinct section once per process, so
no code below the edge reads raw keys or resolves aliases (tests/workspace/
test_config_edge.py checks that). (Over 400 lines:
every field's validation and its one-line error stay together with the dataclass.)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from afd_core.errors import AFDConfigError, did_you_mean
from afd_core.identity import FINGERPRINT_FIELDS
from afd_core.roles import AFDRole
from afd_core.transfer_dtype import TRANSFER_DTYPES

if TYPE_CHECKING:
    from afd_core.topology import AFDTopology

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ASYNC_KEYS",
    "CONFIG_ALIASES",
    "AFDRole",
    "RoutingPayload",
    "AFDConfig",
    "additional_config_json",
    "afd_config_of",
]

ADDITIONAL_CONFIG_KEY = "afd"
"""The key of vLLM's ``additional_config`` that holds the AFD section."""


class RoutingPayload(enum.StrEnum):
    """What the Attention role sends as routing when the gate runs on Attention."""

    TOPK = "topk"
    """top-k expert ids (int32) + weights (float32)."""
    ROUTER_LOGITS = "router_logits"
    """raw router logits; the FFN role runs the router (top-k selection)."""


CONFIG_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "afd_role": "role",
        "afd_connector": "connector",
        "afd_host": "host",
        "afd_port": "port",
        "num_afd_stages": "num_micro_batches",
        "afd_extra_config": "connector_extra_config",
    }
)
"""Key names of the upstream AFD plugin, accepted for compatibility -> canonical field."""

ASYNC_KEYS = ("async", "async_dp")
"""afd-plugin's ``async`` (its field ``async_dp``): async data-parallel runtime patches,
only with ``CAMAsyncAFDConnector``. afd runs data-parallel attention ranks without
patching vLLM and its ``CAMAsyncAFDConnector`` overlaps on its own, so the key is accepted
with afd-plugin's rule (true only with that connector) and changes nothing else."""
ASYNC_CONNECTOR = "CAMAsyncAFDConnector"

# Fields whose value changes the compiled graph / the wire protocol (see compute_hash).
_GRAPH_FIELDS = (
    "role",
    "compute_gate_on_attention",
    "routing_payload",
    "num_micro_batches",
    "connector",
    "transfer_dtype",
    "transfer_dtype_return",
)


def _describe(value: Any) -> str:
    """``'abc' (str)`` -- the value given, on one line, with its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(name: str, expected: str, value: Any) -> AFDConfigError:
    return AFDConfigError(f"afd.{name}: expected {expected}, got {_describe(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    allowed = f"an int in {low}..{high}" if high is not None else f"an int >= {low}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise _fail(name, allowed, value)
    return int(value)


def _check_timeout(name: str, value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise _fail(name, "a finite number of seconds > 0", value)
    return float(value)


def _check_name(name: str, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(name, f"a non-empty string ({what})", value)
    return value.strip()


def _check_enum(name: str, value: Any, enum_cls: type[AFDRole] | type[RoutingPayload]) -> Any:
    if isinstance(value, enum_cls):
        return value
    allowed = " or ".join(repr(m.value) for m in enum_cls)
    if isinstance(value, str):
        try:
            return enum_cls(value.strip().lower())
        except ValueError:
            pass
    raise _fail(name, f"one of {allowed}", value)


def _check_transfer_dtype(name: str, value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in TRANSFER_DTYPES:
        return value.strip().lower()
    raise _fail(name, f"one of {', '.join(repr(v) for v in TRANSFER_DTYPES)}", value)


def _check_allow(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise _fail("fingerprint_allow", "a list of fingerprint field names or '*'", value)
    valid = ("*", *FINGERPRINT_FIELDS)
    for item in items:
        if item not in valid:
            hint = did_you_mean(item, valid)
            hint = f"{hint} " if hint else ""
            raise AFDConfigError(
                f"afd.fingerprint_allow: unknown field {item!r}; {hint}fields: {', '.join(valid)}"
            )
    return tuple(items)


def _check_async(key: str, value: Any, connector: Any) -> None:
    """afd-plugin's ``async`` / ``async_dp`` (see :data:`ASYNC_KEYS`): a bool; true only
    with ``CAMAsyncAFDConnector``, as afd-plugin requires."""
    if not isinstance(value, bool):
        raise _fail(key, "a bool (true or false)", value)
    if value and connector != ASYNC_CONNECTOR:
        raise AFDConfigError(
            f"afd.{key}: true requires connector {ASYNC_CONNECTOR!r} (afd-plugin's rule), got "
            f"{'none named' if connector is None else repr(connector)}; afd needs no async "
            f"data-parallel patches on other connectors: drop {key!r}"
        )


@dataclass(frozen=True, slots=True)
class AFDConfig:
    """Validated AFD settings of one process (both roles share all fields but ``role``/``rank``)."""

    role: AFDRole
    connector: str = "P2pGlooAFDConnector"
    host: str = "127.0.0.1"
    port: int = 29700
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    rank: int | None = None
    """This process's index within its role; None = derived by the runtime."""
    attention_tensor_parallel_size: int = 1
    """vLLM tensor-parallel size of each attention rank (TP worker 0 of a rank exchanges
    with the FFN role for its whole TP group). The FFN role admits only attention ranks
    of this size; the Attention role takes its engine's ``--tensor-parallel-size`` and
    refuses a different value here."""
    ffn_expert_parallel: bool = False
    """The ``num_ffn_ranks`` FFN ranks share one expert set (expert parallelism): FFN rank
    f holds routed experts :func:`afd_core.topology.expert_shard` ``(E, num_ffn_ranks, f)``
    and every attention rank exchanges with every FFN rank, on rendezvous port
    ``port + f`` (see :meth:`expert_plane`)."""
    compute_gate_on_attention: bool = False
    routing_payload: RoutingPayload = RoutingPayload.TOPK
    num_micro_batches: int = 1
    transfer_dtype: str = "model"
    """Format of the hidden states Attention sends to FFN (afd_core.transfer_dtype):
    ``model`` (the model dtype, as computed), ``fp8`` (float8_e4m3fn, one float32 scale
    per token), ``mxfp8`` (float8_e4m3fn, one E8M0 scale per 32 elements) or ``int8``
    (per-token symmetric). The receiver dequantizes to the model dtype."""
    transfer_dtype_return: str = "model"
    """Format of the FFN's answers to Attention (same values as ``transfer_dtype``)."""
    micro_batch_min_tokens: int = 0
    """The Attention role splits a step into micro-batches only when it schedules at least
    this many tokens (0: whenever it has at least ``num_micro_batches`` requests); smaller
    steps run whole. Local to the Attention role (the FFN role serves what arrives)."""
    connect_timeout_s: float = 300.0
    transfer_timeout_s: float = 600.0
    connector_extra_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    auth_token: str | None = field(default=None, repr=False)
    """The deployment's shared secret (prefer ``auth_token_file`` or ``AFD_AUTH_TOKEN``:
    a value here shows in process lists and vLLM's logged config)."""
    auth_token_file: str | None = None
    """A file holding the deployment's shared secret (see :mod:`afd_core.admission`)."""
    fingerprint_allow: tuple[str, ...] = ()
    """Deployment-fingerprint fields allowed to differ between the roles (``"*"``: all);
    see :mod:`afd_core.identity`."""

    def __post_init__(self) -> None:
        # Validation at the boundary: an AFDConfig that exists is valid. Values are
        # normalised (str -> enum, int -> float for timeouts, read-only extra config).
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("role", _check_enum("role", self.role, AFDRole))
        put("connector", _check_name("connector", self.connector, "a registered connector name"))
        put("host", _check_name("host", self.host, "a host name or IP address"))
        put("port", _check_int("port", self.port, 1, 65535))
        put(
            "num_attention_ranks",
            _check_int("num_attention_ranks", self.num_attention_ranks, 1),
        )
        put("num_ffn_ranks", _check_int("num_ffn_ranks", self.num_ffn_ranks, 1))
        if self.rank is not None:
            size = (
                self.num_attention_ranks if self.role is AFDRole.ATTENTION else self.num_ffn_ranks
            )
            own = f"num_{self.role.value}_ranks={size}"
            if not _is_int(self.rank) or not 0 <= self.rank < size:
                raise _fail("rank", f"null or an int in 0..{size - 1} ({own})", self.rank)
        put(
            "attention_tensor_parallel_size",
            _check_int("attention_tensor_parallel_size", self.attention_tensor_parallel_size, 1),
        )
        if not isinstance(self.ffn_expert_parallel, bool):
            raise _fail("ffn_expert_parallel", "a bool (true or false)", self.ffn_expert_parallel)
        if self.ffn_expert_parallel and self.port + self.num_ffn_ranks - 1 > 65535:
            raise AFDConfigError(
                f"afd.port: with ffn_expert_parallel the FFN ranks rendezvous on ports "
                f"{self.port}..{self.port + self.num_ffn_ranks - 1}; choose a port <= "
                f"{65536 - self.num_ffn_ranks}, got {self.port}"
            )
        if not isinstance(self.compute_gate_on_attention, bool):
            raise _fail(
                "compute_gate_on_attention",
                "a bool (true or false)",
                self.compute_gate_on_attention,
            )
        put("routing_payload", _check_enum("routing_payload", self.routing_payload, RoutingPayload))
        if (
            self.routing_payload is RoutingPayload.ROUTER_LOGITS
            and not self.compute_gate_on_attention
        ):
            raise AFDConfigError(
                "afd.routing_payload: 'router_logits' is only allowed with "
                "compute_gate_on_attention=true (the gate runs on FFN otherwise), "
                "got 'router_logits' (str)"
            )
        put("num_micro_batches", _check_int("num_micro_batches", self.num_micro_batches, 1))
        put("transfer_dtype", _check_transfer_dtype("transfer_dtype", self.transfer_dtype))
        put(
            "transfer_dtype_return",
            _check_transfer_dtype("transfer_dtype_return", self.transfer_dtype_return),
        )
        put(
            "micro_batch_min_tokens",
            _check_int("micro_batch_min_tokens", self.micro_batch_min_tokens, 0),
        )
        put("connect_timeout_s", _check_timeout("connect_timeout_s", self.connect_timeout_s))
        put("transfer_timeout_s", _check_timeout("transfer_timeout_s", self.transfer_timeout_s))
        extra = self.connector_extra_config
        if not isinstance(extra, Mapping):
            raise _fail("connector_extra_config", "a mapping with string keys", extra)
        bad_keys = [k for k in extra if not isinstance(k, str)]
        if bad_keys:
            raise _fail("connector_extra_config", "a mapping with string keys", bad_keys[0])
        put("connector_extra_config", MappingProxyType(dict(extra)))
        if self.auth_token is not None and self.auth_token_file is not None:
            raise AFDConfigError(
                "afd.auth_token and afd.auth_token_file: both given; keep one (the file "
                "keeps the token out of process lists)"
            )
        if self.auth_token is not None and (
            not isinstance(self.auth_token, str) or not self.auth_token.strip()
        ):
            # The value is a secret: never echo it.
            raise AFDConfigError(
                f"afd.auth_token: expected a non-empty string, got a "
                f"{type(self.auth_token).__name__}"
            )
        if self.auth_token_file is not None:
            put(
                "auth_token_file",
                _check_name("auth_token_file", self.auth_token_file, "a file path"),
            )
        put("fingerprint_allow", _check_allow(self.fingerprint_allow))

    def __hash__(self) -> int:
        # The generated hash would fail on the read-only mapping; hash the plain data.
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=repr))

    # -- construction ------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def parse(cls, mapping: Mapping[str, Any]) -> AFDConfig:
        """Build from the ``"afd"`` section (canonical keys or upstream aliases)."""
        values = cls.canonical(mapping)
        if "role" not in values or values["role"] is None:
            raise AFDConfigError(
                "afd.role: required, expected 'attention' or 'ffn', got nothing "
                "(set additional_config['afd']['role'] or pass role=)"
            )
        return cls(**values)

    @classmethod
    def canonical(cls, mapping: Mapping[str, Any]) -> dict[str, Any]:
        """The section (or a part of it) under canonical keys: the one place where the
        upstream aliases (:data:`CONFIG_ALIASES`) are resolved; unknown keys and a key
        given twice (as itself and as its alias) are refused. Values are not checked."""
        if not isinstance(mapping, Mapping):
            raise AFDConfigError(f"afd: expected a mapping of settings, got {_describe(mapping)}")
        valid = cls.field_names()
        values: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        async_given: tuple[str, Any] | None = None
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise AFDConfigError(
                    f"afd: expected string keys, got key {_describe(key)}; "
                    f"valid keys: {', '.join(valid)}"
                )
            if key in ASYNC_KEYS:
                if async_given is not None:
                    raise AFDConfigError(
                        f"afd.async: given twice, as {async_given[0]!r} and {key!r}; keep one"
                    )
                async_given = (key, value)
                continue
            canonical = CONFIG_ALIASES.get(key, key)
            if canonical not in valid:
                candidates = [*valid, *CONFIG_ALIASES]
                hint = did_you_mean(key, candidates)
                hint = f"{hint} " if hint else ""
                raise AFDConfigError(
                    f"afd: unknown key {key!r}; {hint}valid keys: {', '.join(valid)} "
                    f"(upstream aliases: {', '.join(CONFIG_ALIASES)})"
                )
            if canonical in given_as:
                raise AFDConfigError(
                    f"afd.{canonical}: given twice, as {given_as[canonical]!r} and {key!r}; "
                    f"keep only {canonical!r}"
                )
            given_as[canonical] = key
            values[canonical] = value
        if async_given is not None:
            _check_async(*async_given, values.get("connector"))
        return values

    @classmethod
    def from_additional_config(
        cls,
        additional_config: Mapping[str, Any] | None,
        *,
        role: AFDRole | str | None = None,
        role_from: str | None = None,
    ) -> AFDConfig:
        """Read ``additional_config["afd"]``; ``role`` fills (or must agree with) the
        section's. ``role_from``: the option that gave ``role`` (e.g. ``--role``), named
        in the error when they disagree."""
        if additional_config is None:
            additional_config = {}
        if not isinstance(additional_config, Mapping):
            raise AFDConfigError(
                f"additional_config: expected a mapping, got {_describe(additional_config)}"
            )
        section = additional_config.get(ADDITIONAL_CONFIG_KEY)
        if section is None:
            if role is None:
                raise AFDConfigError(
                    f"additional_config: expected an {ADDITIONAL_CONFIG_KEY!r} section, got keys "
                    f"{sorted(map(str, additional_config))}; pass --additional-config "
                    """'{"afd": {"role": "attention"}}'"""
                )
            section = {}
        if not isinstance(section, Mapping):
            raise AFDConfigError(f"afd: expected a mapping of settings, got {_describe(section)}")
        if role is not None:
            wanted = _check_enum("role", role, AFDRole)
            merged = dict(section)
            key = next((k for k in ("role", "afd_role") if k in merged), None)
            if key is not None and merged[key] is not None:
                given = _check_enum("role", merged[key], AFDRole)
                if given is not wanted and role_from is not None:
                    raise AFDConfigError(
                        f"{role_from} {wanted.value} conflicts with afd.role={merged[key]!r} "
                        f"(additional_config['afd'][{key!r}]); remove the key or make them agree"
                    )
                if given is not wanted:
                    raise AFDConfigError(
                        f"afd.role: the process runs as {wanted.value!r} but "
                        f"additional_config['afd'][{key!r}] is {merged[key]!r}; "
                        "remove the key or make them agree"
                    )
            if key is None or merged[key] is None:
                merged.pop("role", None)
                merged.pop("afd_role", None)
                merged["role"] = wanted
            section = merged
        return cls.parse(section)

    # -- derived views -------------------------------------------------------------
    @property
    def topology(self) -> AFDTopology:
        from afd_core.topology import AFDTopology

        return AFDTopology(self.num_attention_ranks, self.num_ffn_ranks)

    def expert_plane(self, ffn_rank: int) -> AFDConfig:
        """With ``ffn_expert_parallel``: the settings of the exchange between the attention
        ranks and FFN rank ``ffn_rank`` (a topology of ``num_attention_ranks`` attention
        ranks and one FFN rank, on port ``port + ffn_rank``). For an FFN process,
        ``ffn_rank`` must be its own rank (its plane's FFN rank is 0)."""
        if not self.ffn_expert_parallel:
            raise AFDConfigError("afd.expert_plane: only with afd.ffn_expert_parallel=true")
        if not _is_int(ffn_rank) or not 0 <= ffn_rank < self.num_ffn_ranks:
            raise _fail("ffn rank", f"an int in 0..{self.num_ffn_ranks - 1}", ffn_rank)
        if self.role is AFDRole.FFN and self.rank is not None and self.rank != ffn_rank:
            raise AFDConfigError(
                f"afd.expert_plane: FFN rank {self.rank} asked for the plane of FFN rank {ffn_rank}"
            )
        rank = 0 if self.role is AFDRole.FFN else self.rank
        return dataclasses.replace(
            self,
            num_ffn_ranks=1,
            rank=rank,
            port=self.port + ffn_rank,
            ffn_expert_parallel=False,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict with canonical keys; ``AFDConfig.parse(c.to_dict()) == c``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_section(self) -> dict[str, Any]:
        """The canonical ``additional_config["afd"]`` section: canonical keys, ``role`` and
        the fields that differ from their defaults (JSON-compatible);
        ``AFDConfig.parse(c.to_section()) == c``. What the edge hands to vLLM."""
        defaults = AFDConfig(role=self.role).to_dict()
        data = self.to_dict()
        return {k: v for k, v in data.items() if k == "role" or v != defaults[k]}

    def compute_hash(self) -> str:
        """Stable hash of the fields that change the compiled graph or the wire protocol.

        Host, port, ranks and timeouts are left out: they do not change what is traced,
        so processes that differ only in those share compilation caches.
        """
        data = self.to_dict()
        blob = json.dumps({k: data[k] for k in _GRAPH_FIELDS}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def additional_config_json(config: AFDConfig, additional: Mapping[str, Any] | None = None) -> str:
    """The ``--additional-config`` value that hands ``config`` to a process: ``additional``
    (vLLM's other ``additional_config`` keys) with ``config`` as its ``"afd"`` section in
    canonical keys (:meth:`AFDConfig.to_section`). The one serialiser: the launcher's
    role commands and ``afd serve`` (for its vLLM engine) write the config with it; the
    process reads it back with :func:`afd_config_of` (or
    :meth:`AFDConfig.from_additional_config`)."""
    return json.dumps({**(additional or {}), ADDITIONAL_CONFIG_KEY: config.to_section()})


@functools.lru_cache(maxsize=16)
def _parse_section(blob: str) -> AFDConfig:
    return AFDConfig.parse(json.loads(blob))


def afd_config_of(vllm_config: Any) -> AFDConfig | None:
    """The :class:`AFDConfig` of a vLLM config's ``additional_config["afd"]`` (None without
    that section): what every role process reads instead of raw keys. Each distinct
    section is parsed once per process (an engine's worker, model and FFN server share
    the object); a section that is not plain JSON data is parsed every time."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(extra, Mapping) or extra.get(ADDITIONAL_CONFIG_KEY) is None:
        return None
    section = extra[ADDITIONAL_CONFIG_KEY]
    try:
        blob = json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):
        return AFDConfig.from_additional_config(extra)
    if not isinstance(section, Mapping):
        return AFDConfig.from_additional_config(extra)
    return _parse_section(blob)
