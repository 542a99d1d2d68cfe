"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_moe_runners


def test_installed_version_matches_version_file() -> None:
    assert version("afd-moe-runners") == afd_moe_runners.__version__
