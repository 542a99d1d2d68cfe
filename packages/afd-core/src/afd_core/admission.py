"""Admission to an AFD deployment: who may join it, and whether it serves the same model.

Every rank of a deployment meets at the rendezvous store that attention rank 0 (the
*host*) runs at ``afd.host:afd.port``. Before any rank learns where the others' tensors
go, it passes the host's admission desk:

1. The host publishes a random nonce (``afd-admit/nonce``) and whether a token is
   required.
2. A joining rank draws a ticket, and writes a hello: its role and rank, its deployment
   fingerprint (:mod:`afd_core.identity`) and, with a token, an HMAC-SHA256 proof over
   the nonce, a nonce of its own, its rank and its fingerprint.
3. The host checks the proof, the rank (in range, not taken) and the fingerprint
   against its own, and answers with a verdict, which with a token carries the host's
   own proof (so a process squatting the port before the host cannot admit anyone).
4. Admitted ranks continue under a *session prefix* derived from the token and the
   nonce (:func:`session_prefix`): it is never written to the store, so a process
   without the token cannot read or write any key of the deployment, gloo's included.

A refused process gets one clear error (:class:`~afd_core.errors.AFDAdmissionError`,
or :class:`~afd_core.errors.AFDFingerprintMismatchError` naming each differing field
with both values); the host logs the refusal and keeps serving. While the deployment is
still assembling, a fingerprint mismatch also stops the host: a deployment that was
started on two different checkpoints must not come up at all; so does a second process
claiming a rank (an FFN expert shard) that is already admitted, as the rank it left out
would never come.

What this protects and what it does not is written down in docs/security.md: the
token authenticates who joins; the tensor traffic itself is not encrypted.

The store is anything with ``set``, ``get``, ``check`` and ``add`` (a
``torch.distributed.TCPStore``); nothing here imports torch.

Over 400 lines on purpose: the host's desk and the joining rank's side of the protocol
live together, so each message has one definition.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import (
    AFDAdmissionError,
    AFDConfigError,
    AFDFingerprintMismatchError,
    AFDTimeoutError,
)
from afd_core.identity import PROTOCOL_VERSION, describe_differences, differences
from afd_core.topology import AFDTopology

logger = logging.getLogger("afd.admission")

__all__ = [
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV",
    "AdmissionDesk",
    "KeyValueStore",
    "apply_for_admission",
    "assembling",
    "config_fields",
    "generate_token",
    "resolve_token",
    "session_prefix",
]

TOKEN_ENV = "AFD_AUTH_TOKEN"
"""Environment variable holding the deployment's shared secret (not in process lists)."""

MIN_TOKEN_CHARS = 16

_PREFIX = "afd-admit/"
_POLL_S = 0.02
_SERVICE_INTERVAL_S = 0.25
# How long the host waits for a refused rank to read its verdict before it stops.
_VERDICT_GRACE_S = 5.0
# A ticket whose hello never came is forgotten after this long.
_STALE_TICKET_S = 30.0


class KeyValueStore(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, value: int) -> int: ...


def generate_token() -> str:
    """A fresh deployment token (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _check_token(token: str, source: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise AFDConfigError(
            f"{source}: the AFD token must have at least {MIN_TOKEN_CHARS} characters, got "
            f"{len(token)}; generate one with `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return token


def resolve_token(config: AFDConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """This process's token: ``afd.auth_token``, else the file ``afd.auth_token_file``,
    else the environment variable :data:`AFD_AUTH_TOKEN <TOKEN_ENV>`; None when none is set
    (the deployment admits without a token)."""
    if config.auth_token is not None:
        return _check_token(config.auth_token, "afd.auth_token")
    if config.auth_token_file is not None:
        path = Path(config.auth_token_file).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise AFDConfigError(
                f"afd.auth_token_file: cannot read {str(path)!r} ({exc.strerror or exc}); "
                "give a readable file holding the deployment token"
            ) from exc
        return _check_token(text, f"afd.auth_token_file {str(path)!r}")
    env = os.environ if environ is None else environ
    value = env.get(TOKEN_ENV, "").strip()
    return _check_token(value, TOKEN_ENV) if value else None


def _mac(token: str, *parts: object) -> str:
    message = "|".join(str(p) for p in parts).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def session_prefix(token: str | None, nonce: str) -> str:
    """The store prefix of one deployment's keys: secret when there is a token."""
    if token is None:
        return f"afd-session-{nonce}"
    return f"afd-session-{_mac(token, 'session', nonce)[:32]}"


def _describe(role: str, rank: int) -> str:
    return f"{role} rank {rank}"


def config_fields(config: AFDConfig) -> dict[str, str]:
    """The fingerprint fields that follow from the AFD settings alone."""
    return {
        "protocol": PROTOCOL_VERSION,
        "connector": config.connector,
        "topology": config.topology.label,
        "gate_on_attention": "attention" if config.compute_gate_on_attention else "ffn",
        "routing_payload": (
            config.routing_payload.value if config.compute_gate_on_attention else "none"
        ),
        "transfer_dtype": config.transfer_dtype,
        "transfer_dtype_return": config.transfer_dtype_return,
    }


def _fingerprint(config: AFDConfig, identity: Mapping[str, str] | None) -> dict[str, str]:
    fields = dict(identity or {})
    fields.update(config_fields(config))
    return fields


class _Assembly:
    """A deployment this process is assembling over several rendezvous (see
    :func:`assembling`): what any of its desks refused as a second claim of a taken rank."""

    def __init__(self) -> None:
        self.problems: list[str] = []


_assembly: _Assembly | None = None
_assembly_lock = threading.Lock()


@contextmanager
def assembling() -> Iterator[None]:
    """While the block runs, this process hosts one deployment over several rendezvous
    (attention rank 0 of FFN expert parallelism hosts one per expert plane, joined one
    after another): a second process claiming a rank that one of them already admitted
    (two FFN processes started with one ``afd.rank``, so one expert shard) stops every
    rendezvous still waiting, as the rank that claimant left out will never come. Outside
    the block a late claim of a taken rank is refused and the deployment keeps serving.
    """
    global _assembly
    with _assembly_lock:
        previous, _assembly = _assembly, _Assembly()
    try:
        yield
    finally:
        with _assembly_lock:
            _assembly = previous


def _assembly_problems() -> list[str]:
    with _assembly_lock:
        return list(_assembly.problems) if _assembly is not None else []


def _assembling() -> bool:
    with _assembly_lock:
        return _assembly is not None


def _note_assembly_problem(message: str) -> None:
    """Record ``message`` for the assembly in progress (none: nothing to do)."""
    with _assembly_lock:
        if _assembly is not None:
            _assembly.problems.append(message)


@dataclass
class _Ticket:
    number: int
    seen: float


class AdmissionDesk:
    """The host's side (attention rank 0): publishes the nonce and answers hellos.

    :meth:`service` answers every hello that has arrived; the host calls it while it
    waits for the deployment to assemble, then :meth:`start` answers late ones (a
    restarted peer, a stranger) from a thread until :meth:`stop`.
    """

    def __init__(
        self,
        store: KeyValueStore,
        *,
        config: AFDConfig,
        token: str | None,
        identity: Mapping[str, str] | None,
        where: str,
    ) -> None:
        self._store = store
        self._config = config
        self._token = token
        self._where = where
        self.topology = AFDTopology(config.num_attention_ranks, config.num_ffn_ranks)
        self.fingerprint = _fingerprint(config, identity)
        self.nonce = secrets.token_hex(16)
        self.prefix = session_prefix(token, self.nonce)
        self.admitted: dict[int, str] = {}
        self.refused = 0
        self._tickets: dict[int, _Ticket] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store.set(_PREFIX + "mode", "token" if token is not None else "open")
        store.set(_PREFIX + "nonce", self.nonce)

    @property
    def complete(self) -> bool:
        """Every rank but the host's own was admitted."""
        return len(self.admitted) == self.topology.world_size - 1

    def service(self) -> None:
        """Answer every hello that has arrived.

        Raises :class:`AFDFingerprintMismatchError` when a rank of a deployment that is
        still assembling loaded something else, :class:`AFDAdmissionError` when a second
        process claims a rank that is already admitted while it assembles (after the
        refused rank read its verdict).
        """
        with self._lock:
            mismatch = self._service()
        if mismatch is not None:
            raise mismatch
        if not self.complete:
            problems = _assembly_problems()
            if problems:  # another rendezvous of this deployment saw a rank claimed twice
                raise AFDAdmissionError(problems[0])

    def _service(self) -> AFDConfigError | None:
        store = self._store
        issued = int(store.add(_PREFIX + "ticket", 0))
        now = time.monotonic()
        for number in range(self._next, issued + 1):
            self._tickets[number] = _Ticket(number, now)
        self._next = max(self._next, issued + 1)
        stop: AFDConfigError | None = None
        for number in sorted(self._tickets):
            ticket = self._tickets[number]
            if not store.check([f"{_PREFIX}hello/{number}"]):
                if now - ticket.seen > _STALE_TICKET_S:
                    del self._tickets[number]
                continue
            del self._tickets[number]
            # Once this host stops, the hellos already here are refused with its reason
            # (after their own checks), not left without a verdict.
            mismatch = self._answer(number, store.get(f"{_PREFIX}hello/{number}"), stop)
            stop = stop or mismatch
        return stop

    def _answer(
        self, number: int, raw: bytes, stop: AFDConfigError | None = None
    ) -> AFDConfigError | None:
        try:
            hello = json.loads(raw)
            role = AFDRole(hello["role"])
            rank = int(hello["rank"])
            cnonce = str(hello["cnonce"])
            fingerprint = {str(k): str(v) for k, v in dict(hello["fingerprint"]).items()}
            allow = [str(a) for a in hello.get("allow", [])]
            proof = str(hello.get("proof", ""))
            claim = f"{hello.get('host', '?')} pid {hello.get('pid', '?')}"
        except (ValueError, KeyError, TypeError):
            self._verdict(number, "", "malformed", "the hello was not an AFD hello")
            logger.warning("AFD admission at %s: refused a malformed hello", self._where)
            return None
        who = _describe(role.value, rank)
        reason: str | None = None
        duplicate = False
        kind = "token"
        if self._token is None:
            if proof:
                reason = (
                    "it presented a token, this deployment was started without one; give "
                    "every role the same token (afd.auth_token_file or AFD_AUTH_TOKEN)"
                )
        elif not proof:
            reason = (
                "this deployment requires a token and the process presented none; set "
                "afd.auth_token_file or AFD_AUTH_TOKEN to the deployment's token"
            )
        elif not hmac.compare_digest(
            proof,
            _mac(self._token, "hello", self.nonce, cnonce, role.value, rank, _signed_fields(hello)),
        ):
            reason = "wrong token"
        if reason is None:
            kind = "rank"
            size = self.topology.size_of(role)
            global_rank = self.topology.global_rank(role, rank) if 0 <= rank < size else -1
            if global_rank <= 0:
                reason = (
                    f"{who} does not exist in {self.topology.label}"
                    if global_rank < 0
                    else f"{who} is this host"
                )
            elif global_rank in self.admitted:
                reason = f"{who} is already connected ({self.admitted[global_rank]})"
                if not self.complete or _assembling():
                    # Two processes started with one rank (and so one expert shard) while
                    # the deployment assembles (this rendezvous, or another one of this
                    # process's deployment: `assembling`): the rank they left out never
                    # comes, so the host stops now instead of waiting out
                    # afd.connect_timeout_s.
                    shard = fingerprint.get("expert_shard", "")
                    _, _, of = shard.partition("/")  # "f/n": expert plane f of n FFN ranks
                    ranks = int(of) if of.isdigit() else self.topology.size_of(role)
                    reason += (
                        f"; a second process ({claim}) claims it"
                        + (f" (expert shard {shard})" if shard else "")
                        + f" while {self.topology.label} assembles: start each "
                        f"{role.value} rank with its own afd.rank (0..{ranks - 1})"
                    )
                    duplicate = True
        mismatch: AFDConfigError | None = None
        if reason is None:
            diffs = differences(
                self.fingerprint,
                fingerprint,
                allow=[*self._config.fingerprint_allow, *allow],
            )
            if diffs:
                kind = "fingerprint"
                reason = (
                    "the roles loaded different models or settings: "
                    + describe_differences(diffs, host="attention rank 0", joining=who)
                    + ". Start every role on the same checkpoint and settings, or list a "
                    "deliberate difference in afd.fingerprint_allow"
                )
                if not self.complete:
                    mismatch = AFDFingerprintMismatchError(
                        f"AFD admission at {self._where}: refused {who}: {reason}"
                    )
        if duplicate:
            message = f"AFD admission at {self._where}: refused {who}: {reason}"
            if not self.complete:
                mismatch = AFDAdmissionError(message)
            else:  # this rendezvous is complete; the one still waiting stops on it
                _note_assembly_problem(message)
        if reason is not None:
            self.refused += 1
            self._verdict(number, cnonce, kind, reason)
            logger.warning(
                "AFD admission at %s: refused %s (%s): %s", self._where, who, claim, reason
            )
            if mismatch is not None:
                self._wait_read(number)
            return mismatch
        if stop is not None:
            kind = "fingerprint" if isinstance(stop, AFDFingerprintMismatchError) else "rank"
            reason = f"attention rank 0 stopped the deployment while it assembled: {stop}"
            self.refused += 1
            self._verdict(number, cnonce, kind, reason)
            logger.warning(
                "AFD admission at %s: refused %s (%s): stopping", self._where, who, claim
            )
            return None
        self.admitted[self.topology.global_rank(role, rank)] = claim
        self._verdict(number, cnonce, "", "")
        logger.info("AFD admission at %s: admitted %s (%s)", self._where, who, claim)
        return None

    def _verdict(self, number: int, cnonce: str, kind: str, reason: str) -> None:
        body = {"ok": not kind, "kind": kind, "reason": reason}
        if self._token is not None:
            body["proof"] = _mac(self._token, "welcome", self.nonce, cnonce, not kind)
        self._store.set(f"{_PREFIX}verdict/{number}", json.dumps(body))

    def _wait_read(self, number: int) -> None:
        deadline = time.monotonic() + _VERDICT_GRACE_S
        while time.monotonic() < deadline:
            if self._store.check([f"{_PREFIX}verdict-read/{number}"]):
                return
            time.sleep(_POLL_S)

    # -- after the deployment assembled ----------------------------------------------
    def start(self) -> None:
        """Answer late hellos from a daemon thread (every 0.25 s) until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="afd-admission", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SERVICE_INTERVAL_S):
            try:
                self.service()
            except Exception as exc:  # the store is gone: the deployment is stopping
                logger.debug("AFD admission desk stopped: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * _SERVICE_INTERVAL_S + 1)


def _signed_fields(hello: Mapping[str, Any]) -> str:
    """The canonical text of a hello's fingerprint and allow list (what the proof covers)."""
    return json.dumps([hello.get("fingerprint"), hello.get("allow", [])], sort_keys=True)


def apply_for_admission(
    store: KeyValueStore,
    *,
    config: AFDConfig,
    rank: int,
    token: str | None,
    identity: Mapping[str, str] | None,
    deadline: float,
    where: str,
    label: str,
) -> str:
    """A joining rank's side: say hello, wait for the verdict, return the session prefix.

    Raises :class:`AFDAdmissionError` (refused: token, rank),
    :class:`AFDFingerprintMismatchError` (refused: it loaded something else) or
    :class:`AFDTimeoutError` (no host answered before ``deadline``).
    """
    role = config.role

    def wait(key: str, what: str) -> None:
        while not store.check([key]):
            if time.monotonic() >= deadline:
                raise AFDTimeoutError(
                    f"{label}: no answer from attention rank 0 at {where} while {what}; is "
                    "attention rank 0 running this afd version with the same afd.host/"
                    "afd.port? (raise afd.connect_timeout_s for slow starts)"
                )
            time.sleep(_POLL_S)

    wait(_PREFIX + "nonce", "waiting for its admission desk")
    nonce = store.get(_PREFIX + "nonce").decode()
    mode = store.get(_PREFIX + "mode").decode()
    if mode == "token" and token is None:
        logger.error(
            "%s: the deployment at %s requires a token and this process has none", label, where
        )
    cnonce = secrets.token_hex(16)
    hello: dict[str, Any] = {
        "role": role.value,
        "rank": rank,
        "cnonce": cnonce,
        "fingerprint": _fingerprint(config, identity),
        "allow": list(config.fingerprint_allow),
        "host": _hostname(),
        "pid": os.getpid(),
    }
    hello["proof"] = (
        _mac(token, "hello", nonce, cnonce, role.value, rank, _signed_fields(hello))
        if token
        else ""
    )
    number = int(store.add(_PREFIX + "ticket", 1))
    store.set(f"{_PREFIX}hello/{number}", json.dumps(hello))
    wait(f"{_PREFIX}verdict/{number}", "waiting for its admission verdict")
    verdict = json.loads(store.get(f"{_PREFIX}verdict/{number}"))
    store.set(f"{_PREFIX}verdict-read/{number}", "1")
    if not verdict.get("ok"):
        message = f"{label}: refused by attention rank 0 at {where}: {verdict.get('reason')}"
        if verdict.get("kind") == "fingerprint":
            raise AFDFingerprintMismatchError(message)
        raise AFDAdmissionError(message)
    if token is not None and not hmac.compare_digest(
        str(verdict.get("proof", "")), _mac(token, "welcome", nonce, cnonce, True)
    ):
        raise AFDAdmissionError(
            f"{label}: the process answering at {where} admitted this rank without proving "
            "the deployment token; it is not this deployment's attention rank 0 (another "
            "deployment, or a process squatting the port)"
        )
    return session_prefix(token, nonce)


def _hostname() -> str:
    import socket

    return socket.gethostname()
