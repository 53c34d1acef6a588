"""The command line every peer script takes (``trl_grpo.py``, ``areal_grpo.py``), as
``benchmarks/bench_vs_peers.py`` calls them."""

from __future__ import annotations

import argparse


def peer_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the warm start (an HF model directory)")
    ap.add_argument("--train", required=True, help="JSON lines: prompt, answer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="save the model every k rounds under <out>/snapshots/round_<k> (0: none)")
    return ap
