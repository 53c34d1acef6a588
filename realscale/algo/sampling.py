"""Sampling and THE log-prob convention shared by generation and training.

Log-prob convention (the trainer imports :data:`LOGPROB_CONVENTION` and
:func:`token_logprobs` so both sides compute the same number):

    logprob(token) = log_softmax(logits / T)[token]       T = the sampling temperature

over the *whole* vocabulary, in float32, *before* top-k / top-p truncation. Greedy
decoding (temperature 0) uses T = 1. Truncation changes which tokens can be drawn, not
the reported log-prob: this keeps behaviour log-probs (from the server) and proximal
log-probs (recomputed by the trainer from logits) comparable token by token, which the
decoupled PPO importance weight ``exp(logp_prox - logp_behav)`` needs. SGLang reports
log-probs of the temperature-scaled distribution in the same way.
"""

from __future__ import annotations

import torch

LOGPROB_CONVENTION = "log_softmax(logits / temperature)[token], full vocab, fp32, before top-k/top-p; T=0 -> T=1"

# Below this a temperature means greedy (as in SGLang's SamplingParams).
GREEDY_EPS = 1e-6


def effective_temperature(temperature: float) -> float:
    """The T of the log-prob convention: greedy (T ~ 0) reports log-probs at T = 1."""
    return 1.0 if temperature < GREEDY_EPS else float(temperature)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Log-probs of ``tokens`` under ``logits`` (``[..., V]``) by the shared convention."""
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature).to(torch.float32)
        scaled = logits.float() / t.unsqueeze(-1)
    else:
        scaled = logits.float() / effective_temperature(temperature)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (the top token always stays)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    drop = (top_k.unsqueeze(-1) > 0) & (rank >= top_k.unsqueeze(-1))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` ``[B, V]``; return (tokens, their log-probs).

    ``temperature``/``top_p`` are float ``[B]``, ``top_k`` int ``[B]`` (<= 0: off). Rows
    with temperature ~ 0 are greedy.
    """
    logits = logits.float()
    greedy = temperature < GREEDY_EPS
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t.unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = scaled.argmax(dim=-1)
    else:
        if bool(((top_k > 0) | (top_p < 1.0)).any()):
            scaled = _truncate(scaled, top_k, top_p)
        # Gumbel-max via exponential races: argmax(p / E) with E ~ Exp(1) is a draw from p,
        # one vectorised op for the whole batch instead of a multinomial per row.
        noise = torch.empty_like(scaled).exponential_(generator=generator)
        drawn = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
