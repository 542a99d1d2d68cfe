"""A stranger at a running deployment's rendezvous: ``python afd_rogue.py PORT``.

It claims FFN rank 0 with the gloo connector, with whatever token its environment
(``AFD_AUTH_TOKEN``) holds, and prints how the deployment answered. Exit code 0: it was
refused (AFDAdmissionError); 1: it was admitted or failed otherwise.
"""

from __future__ import annotations

import sys

from afd_core.config import AFDConfig
from afd_core.errors import AFDAdmissionError
from afd_core.registry import create_connector


def main(port: int) -> int:
    config = AFDConfig(role="ffn", port=port, rank=0, connect_timeout_s=20.0)
    connector = create_connector(config, rank=0)
    try:
        connector.init()
    except AFDAdmissionError as exc:
        print(f"refused: {exc}", flush=True)
        return 0
    except Exception as exc:
        print(f"failed otherwise: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        connector.close()
    print("admitted", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
