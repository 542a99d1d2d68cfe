"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd


def test_installed_version_matches_version_file() -> None:
    assert version("afd") == afd.__version__
