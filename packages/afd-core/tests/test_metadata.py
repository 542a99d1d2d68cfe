"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_core


def test_installed_version_matches_version_file() -> None:
    assert version("afd-core") == afd_core.__version__
