import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=200, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) tiny GGUF files, written once per test session."""
    from tools.make_tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_bundles(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) bundles converted from the tiny GGUF pair."""
    from lever_actors.convert import convert

    out = tmp_path_factory.mktemp("bundles")
    return tuple(convert(g, out / (g.stem + ".bundle"), progress=lambda m: None) for g in tiny_gguf)
