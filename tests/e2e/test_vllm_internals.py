"""Pinned vLLM internals: fail loudly when an internal that remp touches moves."""

import warnings

import pytest

from node_agent import engine_plugin

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True, scope="module")
def _vllm_imported():
    """Import vLLM once with its (and torch's) own import-time deprecation noise silenced; the
    warnings-as-errors setting stays on for everything remp does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine_plugin.check_internals()


def test_every_internal_resolves_on_the_pinned_vllm():
    assert engine_plugin.check_internals() == engine_plugin.PINNED_VLLM_VERSION


def test_a_moved_internal_fails_loudly(monkeypatch):
    moved = [*engine_plugin.INTERNALS,
             ("vllm.v1.engine.core", "EngineCore.remp_does_not_exist", "canary")]
    monkeypatch.setattr(engine_plugin, "INTERNALS", moved)
    with pytest.raises(engine_plugin.VllmInternalsMoved, match="EngineCore.remp_does_not_exist"):
        engine_plugin.check_internals()


def test_a_renamed_metric_fails_loudly(monkeypatch):
    """The heartbeat reads vLLM's metrics by name (TPOT for the policy's calibration): a rename
    would leave them silently 0."""
    monkeypatch.setattr(engine_plugin, "TRAFFIC_HISTOGRAMS",
                        {**engine_plugin.TRAFFIC_HISTOGRAMS, "tpot": "vllm:remp_renamed_tpot"})
    with pytest.raises(engine_plugin.VllmInternalsMoved, match="vllm:remp_renamed_tpot"):
        engine_plugin.check_internals()


def test_general_plugin_is_registered_as_entry_point():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("remp") == "node_agent.engine_plugin.core_side:register"
