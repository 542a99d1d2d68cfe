"""``python -m afd.reference``: the entry point of :mod:`afd.tools.reference`.

The native greedy reference lives in :mod:`afd.tools.reference`; this module keeps the
command ``python -m afd.reference MODEL_DIR ...`` that scripts and the test helpers run
in a fresh process (import from :mod:`afd.tools.reference` in code). Nothing is imported
at module level, so vLLM's environment is still set by :mod:`afd.tools.reference`
before vLLM loads.
"""

from __future__ import annotations

if __name__ == "__main__":
    from afd.tools.reference import _main

    raise SystemExit(_main())
