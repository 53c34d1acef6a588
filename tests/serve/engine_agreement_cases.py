"""Worker for the server-vs-trainer log-prob test (a spawned trainer rank imports it)."""

from __future__ import annotations

import torch


def engine_logprobs(model_dir: str, seqs: list[list[int]], temperature: float) -> list[torch.Tensor]:
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, lr=None, temperature=temperature,
                                      logprob_chunk_tokens=7, max_tokens_per_micro_batch=64))
    batch = PackedBatch.from_sequences(seqs)
    lp = eng.logprobs(batch)["logprobs"]
    return [lp[int(batch.cu_seqlens[i]): int(batch.cu_seqlens[i + 1])] for i in range(batch.num_seqs)]
