"""The installed distribution's metadata matches the package's version file."""

from importlib.metadata import version

import afd_models_qwen


def test_installed_version_matches_version_file() -> None:
    assert version("afd-models-qwen") == afd_models_qwen.__version__
