import pytest

from remp.modelgen import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The project's deterministic tiny random Llama (bf16 checkpoint)."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")
