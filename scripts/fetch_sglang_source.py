"""Fetch SGLang's protocol source files for the contract tests (no install, no deps).

    python scripts/fetch_sglang_source.py     # -> ~/.cache/realscale/sglang (or $REALSCALE_CACHE/sglang)
"""

from realscale.generate.sglang_reference import fetch

if __name__ == "__main__":
    print(f"SGLang protocol sources in {fetch()}")
