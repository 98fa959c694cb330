import hashlib
import json

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from devstack.modelgen import TinyLlamaSpec, make_model, weight_shapes


def digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes(tmp_path):
    a = make_model(tmp_path / "a")
    b = make_model(tmp_path / "b")
    assert digest(a) == digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(digest(a))


def test_other_seed_other_weights(tmp_path):
    a = make_model(tmp_path / "a")
    b = make_model(tmp_path / "b", TinyLlamaSpec(seed=1))
    assert digest(a)["model.safetensors"] != digest(b)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(b)["tokenizer.json"]


def test_default_shape_and_weights(tmp_path):
    d = make_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (256, 4, 8, 4, 2048)
    assert cfg["torch_dtype"] == "bfloat16"
    shapes = weight_shapes(TinyLlamaSpec())
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(shapes)
        for k in f.keys():
            t = f.get_tensor(k)
            assert tuple(t.shape) == shapes[k]
            assert str(t.dtype) == "torch.bfloat16"
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        assert k.shape == (4 * 32, 256)
        assert 0.05 < float(k.float().std()) < 0.11  # init_std 0.08: logits not flat


def test_tokenizer_round_trip(tmp_path):
    d = make_model(tmp_path / "m")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    enc = tok.encode("t5 t6 t2047 nope")
    assert enc.ids == [1, 5, 6, 2047, 0]  # BOS prepended, unknown word -> <unk>
    assert tok.decode(enc.ids) == "t5 t6 t2047"  # specials skipped
    assert tok.get_vocab_size() == 2048


def test_spec_validation():
    with pytest.raises(ValueError):
        TinyLlamaSpec(num_attention_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError):
        TinyLlamaSpec(hidden_size=250)
