"""Testing kit for connector and model packages (needs torch: ``afd-core[testing]``).

* :mod:`afd_core.testing.loopback` -- in-process ``LoopbackAFDConnector`` and ``LoopbackHarness``;
* :mod:`afd_core.testing.conformance` -- the scenarios every connector must pass;
* :mod:`afd_core.testing.threads` -- run one body per rank in threads (in-process harnesses).

This package's ``__init__`` imports nothing, so ``import afd_core.testing`` stays cheap.
"""
