"""Why an AFD role stopped, passed from the process that saw it to the one that exits.

The Attention role's AFD runtime lives in vLLM's worker process, two processes below the
server whose exit code a supervisor reads, and vLLM's API server exits 0 whenever its
engine stops. So the server's launcher (``afd serve``) names a file in
:data:`EXIT_REASON_ENV`, the runtime appends the error that stopped it there
(:func:`record_exit_reason`), and the launcher turns a recorded reason into a non-zero
exit code (:func:`read_exit_reasons`). Nothing here imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXIT_REASON_ENV", "read_exit_reasons", "record_exit_reason"]

EXIT_REASON_ENV = "AFD_EXIT_REASON_FILE"


def record_exit_reason(reason: str) -> bool:
    """Append ``reason`` as one line to the file named by :data:`EXIT_REASON_ENV`.

    Returns False when no file is configured or it cannot be written.
    """
    path = os.environ.get(EXIT_REASON_ENV)
    if not path:
        return False
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(" ".join(reason.split()) + "\n")
    except OSError:
        return False
    return True


def read_exit_reasons(path: str | os.PathLike[str]) -> list[str]:
    """The reasons recorded in ``path``, oldest first (none if it does not exist)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if line.strip()]
