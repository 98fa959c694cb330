import pytest

from remp.topology import ModelShape, Topology, candidate_topologies, topology_problems

TINY = ModelShape(num_layers=4, num_attention_heads=8, num_kv_heads=4, hidden_size=256, head_size=32)


@pytest.mark.parametrize("text,tp,pp", [("TP2PP1", 2, 1), ("tp1pp4", 1, 4), ("TP4xPP2", 4, 2),
                                         ("TP8×PP1", 8, 1), (" TP2 PP2 ", 2, 2)])
def test_parse(text, tp, pp):
    t = Topology.parse(text)
    assert (t.tp, t.pp) == (tp, pp)
    assert str(Topology.parse(str(t))) == str(t)


@pytest.mark.parametrize("text", ["", "TP2", "PP2", "2x2", "TPaPP1", "TP-1PP2"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="expected the form TP<n>PP<m>"):
        Topology.parse(text)


def test_tiny_model_all_tp_pp_up_to_4_are_valid():
    valid = candidate_topologies(TINY, devices=16)
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            assert Topology(tp, pp) in valid
    assert Topology(8, 1) not in valid  # 4 KV heads
    assert Topology(1, 8) not in valid  # 4 layers
    assert Topology(1, 3) in valid  # uneven stages: layers [1, 2, 1]
    assert Topology(3, 1) not in valid


def test_candidates_limited_by_devices_and_ordered():
    assert candidate_topologies(TINY, devices=2) == [Topology(1, 1), Topology(2, 1), Topology(1, 2)]
    four = candidate_topologies(TINY, devices=4)
    assert four == [Topology(1, 1), Topology(2, 1), Topology(1, 2), Topology(1, 3),
                    Topology(4, 1), Topology(2, 2), Topology(1, 4)]


def test_problems_name_every_reason():
    probs = topology_problems(Topology(3, 5), TINY, devices=4)
    text = " ".join(probs)
    assert "attention heads" in text and "KV heads" in text
    assert "more stages than the 4 layers" in text
    assert "more than the 4 devices" in text
    assert topology_problems(Topology(2, 2), TINY, devices=4) == []
    assert topology_problems(Topology(0, 1), TINY, devices=4)


def test_world_size():
    assert Topology(4, 2).world_size == 8


def test_shape_rejects_nonpositive():
    with pytest.raises(ValueError):
        ModelShape(num_layers=0, num_attention_heads=8, num_kv_heads=4, hidden_size=256, head_size=32)
