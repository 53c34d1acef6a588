"""How text becomes the token ids the rollouts, SFT and evaluation share: the chat-template
layout of a prompt and of an environment's observation, and what a tokenizer must offer.

One definition each, so that SFT demonstrations, RL prompts and held-out evaluation lay
out tokens exactly alike.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    """What realscale uses of a Hugging Face tokenizer (``transformers.PreTrainedTokenizerBase``)."""

    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None  # read with getattr(..., None): a stand-in without a template may lack it

    def __call__(self, text: str, **kwargs: Any) -> Any: ...
    def encode(self, text: str, **kwargs: Any) -> list[int]: ...
    def decode(self, ids: Any, **kwargs: Any) -> str: ...
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn in the tokenizer's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def observation_ids(tokenizer: Tokenizer, observation: str) -> list[int]:
    """Tokens an environment's observation adds after a model turn: a ``tool`` message in
    the chat template, then the generation prompt of the next answer (the multi-turn
    workflow's layout; SFT demonstrations of tool use are built the same way)."""
    text = tokenizer.apply_chat_template([{"role": "tool", "content": observation}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode("\n" + text, add_special_tokens=False))
