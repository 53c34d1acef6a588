"""Tiny models built locally: no model hub is needed to run, test or benchmark realscale.

:func:`build_tiny_model` writes a complete Hugging Face model directory: ``config.json``
(a real ``Qwen2Config`` / ``Qwen3Config`` / ``Qwen3MoeConfig`` / ``LlamaConfig``), ``model.safetensors`` with
seeded random weights, and a tokenizer (``tokenizer.json`` +
``tokenizer_config.json``, byte-level: one token per ASCII character) that
``AutoTokenizer.from_pretrained`` loads offline.

Weights are initialised the way the HF families initialise their own models
(``PreTrainedModel._init_weights``: linear and embedding weights normal(0,
``initializer_range`` = 0.02), norms 1, biases 0). An untrained model therefore samples
nearly uniformly at temperature 1, as a real untrained model does. (An earlier build drew
the embedding with std 1: with Qwen's tied output layer the logit of the last input
token then dwarfed all others, and the model repeated it with log-prob 0.)

:func:`resolve_model_path` turns a built-in name (``tiny-qwen2``, ``tiny-qwen3``,
``tiny-qwen3-moe``, ``tiny-llama``, ``small-qwen2``) into such a directory, built once into a cache
(``$REALSCALE_CACHE/models/<name>.v<format>``, default ``~/.cache/realscale/models/...``;
the build format is in the name so that checkouts of different versions sharing a cache
never replace each other's copy); an existing directory is returned unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from realscale.errors import UserError
from realscale.models.cache import build_atomically, cache_root
from realscale.models.gguf import smollm2_dir

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")
# The tiny mixture of experts: 4 experts, 2 per token, each a quarter of a dense MLP's width.
TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001}

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<unk>")

# ChatML, the format Qwen models use; Llama-family tiny models share it because the
# tokenizer is ours anyway.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Built-in names -> build_tiny_model keyword arguments. ``small-qwen2`` (~5M parameters) is
# the benchmark model; the others are for tests (a few hundred thousand parameters).
BUILTIN: dict[str, dict[str, Any]] = {
    "tiny-qwen2": {"family": "qwen2"},
    "tiny-qwen3": {"family": "qwen3"},
    "tiny-qwen3-moe": {"family": "qwen3_moe"},
    "tiny-llama": {"family": "llama"},
    "small-qwen2": {"family": "qwen2", "hidden_size": 256, "num_layers": 6, "num_heads": 8,
                    "num_kv_heads": 2, "intermediate_size": 768},
}

# Bump when the built files change in a way a cached copy must not survive.
_BUILD_FORMAT = 3


class ModelNotFoundError(UserError):
    """A model path that is neither a built-in name nor an HF model directory."""


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes 0..255 used by byte-level BPE (GPT-2's map).

    Bytes that are printable Latin-1 stand for themselves; the others (control bytes,
    space, ...) are shifted to code points from 256 up, e.g. space -> "Ġ".
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = 0
    table = {}
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return [table[b] for b in range(256)]


def build_tokenizer(out_dir: str) -> Any:
    """Write a byte-level, one-token-per-byte tokenizer to ``out_dir`` and return it.

    Every ASCII character is one token (any other text is its UTF-8 bytes). It is BPE
    with an empty merge list over the byte-level alphabet, which is what transformers'
    own Qwen2Tokenizer rebuilds from the files (AutoTokenizer ignores a Qwen2 model's
    tokenizer pipeline and reconstructs it), so every family loads the same tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_alphabet():
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token="<unk>",
        bos_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def make_config(family: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, intermediate_size: int, tie_embeddings: bool, eos_id: int,
                moe: dict[str, Any] | None = None) -> Any:
    """The transformers config object of a tiny model of ``family`` (``moe``: Qwen3-MoE
    fields replacing :data:`TINY_MOE`'s)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=4096,
        tie_word_embeddings=tie_embeddings, eos_token_id=eos_id, pad_token_id=eos_id,
        bos_token_id=eos_id, rms_norm_eps=1e-6,
    )
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "llama": LlamaConfig}[family]
    if family in ("qwen3", "qwen3_moe"):
        common["head_dim"] = hidden_size // num_heads
    if family == "qwen3_moe":
        common.update(TINY_MOE, **(moe or {}))
    elif moe:
        raise ValueError(f"mixture-of-experts fields given for the dense family {family!r}")
    return cls(**common)


def build_tiny_model(out_dir: str, family: str = "qwen2", hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     tie_embeddings: bool | None = None, seed: int = 0, moe: dict[str, Any] | None = None) -> str:
    """Write a tiny HF model directory (config, seeded weights, tokenizer); return its path.

    ``tie_embeddings`` defaults to the family's habit for small models (Qwen ties, Llama
    does not). The vocabulary is the tokenizer's, rounded up to a multiple of 8.
    """
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir)
    if tie_embeddings is None:
        tie_embeddings = family != "llama"
    config = make_config(family, _round_up(len(tok), 8), hidden_size, num_layers, num_heads, num_kv_heads,
                         intermediate_size, tie_embeddings, tok.eos_token_id, moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the family's own init
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    return out_dir


def builtin_cache_dir(name: str) -> str:
    """The cached directory of built-in model ``name`` in the current build format."""
    return os.path.join(cache_root(), f"{name}.v{_BUILD_FORMAT}")


def _spec_stamp(name: str) -> dict[str, Any]:
    return {"name": name, "format": _BUILD_FORMAT, "kwargs": BUILTIN[name]}


def _is_complete(path: str, name: str) -> bool:
    stamp = os.path.join(path, "realscale_tiny.json")
    if not os.path.isfile(stamp):
        return False
    with open(stamp, encoding="utf-8") as fh:
        return json.load(fh) == _spec_stamp(name)


def resolve_model_path(name_or_path: str) -> str:
    """A model directory for a built-in tiny-model name or an existing HF directory.

    Built-in models are built once per cache; concurrent callers are safe because each
    builds into its own temporary directory and renames it into place (the loser of a
    race discards its copy).
    """
    if name_or_path in BUILTIN:
        target = builtin_cache_dir(name_or_path)
        if _is_complete(target, name_or_path):
            return target
        def build(tmp: str) -> None:
            build_tiny_model(tmp, **BUILTIN[name_or_path])
            with open(os.path.join(tmp, "realscale_tiny.json"), "w", encoding="utf-8") as fh:
                json.dump(_spec_stamp(name_or_path), fh)

        return build_atomically(target, build, lambda path: _is_complete(path, name_or_path))
    if name_or_path == "smollm2-135m":  # a real pretrained model, from a PyPI package (realscale/models/gguf.py)

        return smollm2_dir()
    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ModelNotFoundError(f"model directory {name_or_path!r} has no config.json: put the HF model's "
                                     "files there (config.json, *.safetensors, tokenizer)")
        return name_or_path
    raise ModelNotFoundError(f"model {name_or_path!r} is neither an existing directory nor a built-in model "
                             f"({', '.join(BUILTIN)}, smollm2-135m): download the HF model to that path (e.g. "
                             "huggingface-cli download <repo> --local-dir <path>) or set model.path")
