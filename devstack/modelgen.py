"""Deterministic, offline tiny Llama builder (``remp make-model DIR``).

Writes a HuggingFace-style Llama checkpoint that vLLM loads with no hub access: ``config.json``,
``model.safetensors`` (random weights from a seeded NumPy PCG64 stream, stable across library
versions), a word-level tokenizer built with ``tokenizers`` (``tokenizer.json``) with a chat
template. Same arguments and seed -> byte-identical files.

Defaults (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab 2048) make TP in {1, 2, 4} and PP in
{1, 2, 4} all valid.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>"]


@dataclass(frozen=True)
class TinyLlamaSpec:
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    dtype: str = "bfloat16"
    seed: int = 0
    init_std: float = 0.08  # large enough that logits are not flat: greedy is not tie-prone

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        if self.vocab_size <= len(SPECIAL):
            raise ValueError(f"vocab_size must be more than {len(SPECIAL)}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads


def hf_config(spec: TinyLlamaSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": spec.init_std,
        "torch_dtype": spec.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "remp_tiny_model": asdict(spec),
    }


def weight_shapes(spec: TinyLlamaSpec) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and shapes, in a fixed order."""
    h, kv, inter = spec.hidden_size, spec.num_kv_heads * spec.head_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (spec.vocab_size, h)}
    return shapes


def make_weights(spec: TinyLlamaSpec):
    import torch

    rng = np.random.Generator(np.random.PCG64(spec.seed))
    dtype = getattr(torch, spec.dtype)
    out = {}
    for name, shape in weight_shapes(spec).items():
        if len(shape) == 1:  # RMSNorm weights
            arr = np.ones(shape, dtype=np.float32)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.init_std)
        out[name] = torch.from_numpy(arr).to(dtype).contiguous()
    return out


def build_tokenizer(spec: TinyLlamaSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL), spec.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)  # same ids as in the vocab; skipped when decoding
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    return tok


def make_model(out_dir: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", hf_config(spec))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False},
    )
    save_file(make_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(build_tokenizer(spec).to_str(pretty=True) + "\n")
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "add_bos_token": True,
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"},
    )
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
