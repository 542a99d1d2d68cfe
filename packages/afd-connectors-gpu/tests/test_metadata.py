"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_connectors_gpu


def test_installed_version_matches_version_file() -> None:
    assert version("afd-connectors-gpu") == afd_connectors_gpu.__version__
