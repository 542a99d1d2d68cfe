"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_models_deepseek


def test_installed_version_matches_version_file() -> None:
    assert version("afd-models-deepseek") == afd_models_deepseek.__version__
