"""A tiny Llama-architecture checkpoint generated locally, for the embedded default and tests.

No model hub is needed: the weights are random (fixed seed), the tokenizer is a byte-level
BPE trained here on a fixed word corpus, and the chat template is ChatML-like (with
Hermes-style tools and tool calls). The result is
a normal Hugging Face directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) that vLLM loads
offline like any real checkpoint. Its text is gibberish; its shapes, tokenizer, chat
template and KV cache are real, which is what serving and KV transfer need.

The same seed and shape always give the same files, so greedy outputs are reproducible.
The weights are fp32 with a wider-than-usual init so that greedy decoding has clear
argmaxes (bf16 on a random tiny model produces near-ties that differ across kernels).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_SHAPE",
    "TinyModelShape",
    "generate_tiny_model",
    "generate_tiny_tokenizer",
    "is_tiny_model_dir",
]

CHAT_TEMPLATE = (
    # With tools: a system turn listing them (and the system message, if first), and
    # Hermes-style calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>), the
    # format vLLM's ``hermes`` tool parser reads. Without tools, each message renders
    # as <|im_start|>role\ncontent<|im_end|>\n.
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return a JSON object with the function's name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": '
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}"
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MARKER = "kvtide_tiny_model"

# A fixed vocabulary of everyday and serving words; the BPE merges are learnt from
# sentences sampled out of it with a fixed seed.
_WORDS = (
    "the of and to in is that it for on with as was at by be this from or have an are "
    "not but had his they you were her she all one their there which we when can will "
    "said if do each about how up out them then many some so these would other into has "
    "more two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too "
    "any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show "
    "large often together asked house world going want school important until form food "
    "keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light "
    "parts country father let night following picture being study second eyes soon times "
    "story boys since white days ever paper hard near sentence better best across during "
    "today others however sure means knew try told young miles sun ways thing whole hear "
    "example heard several change answer room sea against top turned learn point city play "
    "toward five using himself usually model token cache prefill decode engine request "
    "session turn context memory transfer block layer tensor parallel domain rack node "
    "agent tool result plan search code test build deploy latency throughput batch queue"
).split()


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyModelShape:
    """Shape of the generated Llama model. Defaults: ~6M parameters, 8,192-token context."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    initializer_range: float = 0.08
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4


DEFAULT_SHAPE = TinyModelShape()


def is_tiny_model_dir(path: str | Path, shape: TinyModelShape = DEFAULT_SHAPE) -> bool:
    """True when ``path`` already holds a tiny model generated with ``shape``."""
    marker = Path(path) / "kvtide_tiny_model.json"
    if not marker.is_file() or not (Path(path) / "model.safetensors").is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == _shape_dict(shape))
    except (OSError, ValueError):
        return False


def _shape_dict(shape: TinyModelShape) -> dict[str, object]:
    # 2: the chat template renders tools and tool calls.
    return {_MARKER: 2, **{f: getattr(shape, f) for f in shape.__dataclass_fields__}}


def _corpus(seed: int, num_sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."
        for _ in range(num_sentences)
    ]


def _build_tokenizer(out: Path, shape: TinyModelShape) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(shape.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": shape.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def _config(shape: TinyModelShape, vocab_size: int, eos_token_id: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": shape.initializer_range,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _write_weights(out: Path, shape: TinyModelShape, vocab_size: int) -> int:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(shape.seed)
    std = shape.initializer_range
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    kv = shape.num_key_value_heads * d

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float32) * std

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab_size, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": normal(vocab_size, h),
    }
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def generate_tiny_tokenizer(path: str | Path, shape: TinyModelShape = DEFAULT_SHAPE) -> Path:
    """Write only the tiny model's tokenizer (with its chat template) to ``path``: what
    tests of rendering and tokenizing need, without torch or weights. The files are those
    of ``generate_tiny_model`` with the same shape."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out, shape)
    return out


def generate_tiny_model(path: str | Path, shape: TinyModelShape = DEFAULT_SHAPE) -> Path:
    """Write the tiny model to ``path`` (created if missing) and return it.

    Idempotent: a directory that already holds the same shape is left as it is.
    """
    out = Path(path)
    if is_tiny_model_dir(out, shape):
        return out
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out, shape)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    vocab_size = max(len(vocab), max(ids.values()) + 1)
    eos = ids["<|im_end|>"]
    (out / "config.json").write_text(json.dumps(_config(shape, vocab_size, eos), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "bos_token_id": eos}, indent=2)
    )
    _write_weights(out, shape, vocab_size)
    # Written last: its presence means the directory is complete.
    (out / "kvtide_tiny_model.json").write_text(json.dumps(_shape_dict(shape), indent=2))
    return out
