"""Typed errors raised by afd packages.

Every error message says what was expected, what was found and what to change.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "did_you_mean",
    "AFDError",
    "AFDConfigError",
    "AFDConnectorError",
    "AFDTimeoutError",
    "AFDPeerLostError",
    "AFDConnectorClosedError",
    "AFDTransferMismatchError",
    "AFDMetadataMissingError",
    "UnknownConnectorError",
    "AFDAdmissionError",
    "AFDFingerprintMismatchError",
]


class AFDError(Exception):
    """Base class of every error raised by afd."""


class AFDConfigError(AFDError, ValueError):
    """The ``additional_config["afd"]`` section (or a value derived from it) is invalid."""


class UnknownConnectorError(AFDConfigError, LookupError):
    """No connector is registered under the requested name."""


class AFDAdmissionError(AFDConfigError):
    """The deployment refused this process (token missing or wrong, rank taken), or the
    process answering at the rendezvous address could not prove the token."""


class AFDFingerprintMismatchError(AFDConfigError):
    """The roles loaded different models or settings (see :mod:`afd_core.identity`); the
    message names every differing field with both values."""


class AFDConnectorError(AFDError, RuntimeError):
    """A connector failed to move data between the roles."""


class AFDTimeoutError(AFDConnectorError, TimeoutError):
    """A send or receive did not complete within its timeout."""


class AFDPeerLostError(AFDConnectorError, ConnectionError):
    """The peer process went away (exited, crashed or closed its side).

    ``goodbye`` is True when the peer closed its connector on purpose (it said so:
    a SHUTDOWN message or the transport's own close flag) rather than vanishing; a role
    whose peers left that way stopped cleanly.
    """

    def __init__(self, *args: object, goodbye: bool = False) -> None:
        super().__init__(*args)
        self.goodbye = goodbye

    def __reduce__(self) -> tuple[object, ...]:
        return (_peer_lost, (self.args, self.goodbye))


def _peer_lost(args: tuple[object, ...], goodbye: bool) -> AFDPeerLostError:
    return AFDPeerLostError(*args, goodbye=goodbye)


class AFDConnectorClosedError(AFDConnectorError):
    """The connector was closed locally; pending and later transfers fail with this."""


class AFDTransferMismatchError(AFDConnectorError):
    """A received message does not match what the receiver expected (layer, shape, dtype...)."""


class AFDMetadataMissingError(AFDError, LookupError):
    """The per-step AFD metadata is not present in vLLM's forward context."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for the choice closest to ``word``, or ``""`` if none is
    close: the hint of every "unknown key / name" message."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else ""
