"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_connectors_npu


def test_installed_version_matches_version_file() -> None:
    assert version("afd-connectors-npu") == afd_connectors_npu.__version__
