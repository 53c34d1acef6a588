"""Fetch the pinned SGLang's source files for the contract tests (no install, no deps).

    python scripts/fetch_sglang_source.py     # -> ~/.cache/realscale/sglang (or $REALSCALE_CACHE/sglang)

Downloads exactly ``realscale.inference.sglang_reference.PINNED`` with ``pip download
--no-deps`` and unpacks its protocol files (plus the msgspec wheel its generated API
contract module imports); nothing is installed.
"""

from realscale.inference.sglang_reference import PINNED, fetch

if __name__ == "__main__":
    print(f"SGLang {PINNED} protocol sources in {fetch()}")
