"""Demonstrations for supervised fine-tuning: rows -> (token ids, loss mask).

Two row layouts (one JSON object per line, or Parquet rows; ``realscale data convert
--target sft`` writes the first):

- ``prompt`` + ``response``: the prompt as one user turn in the model's chat template
  with the generation prompt (exactly the RL workflow's prompt layout,
  :func:`realscale.data.tokens.prompt_ids`; the bare text for a model without a
  template), then the response's tokens and the EOS token;
- ``messages``: a chat (``role`` / ``content``), rendered whole by the chat template.

The loss mask is 1 on exactly the tokens the model must produce: the response and its
EOS, or every assistant turn (its content and the template's end-of-turn marker, found
through the character offsets of the rendered conversation; a template that renders a
conversation's prefix differently from the whole conversation cannot be masked this
way, and such a row is refused). It follows the engine's log-prob alignment (``logp[j]``
predicts token ``j``), as the task's :func:`realscale.tasks.arith.encode_example` does.

Rows longer than ``max_seq_len`` tokens are refused and counted, not cut: a cut response
loses its final answer.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from realscale.data.tokens import Tokenizer, prompt_ids

Example = tuple[list[int], list[float]]


def has_chat_template(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_tokens(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The RL workflow's prompt layout, or the bare text for a model without a chat template."""
    if has_chat_template(tokenizer):
        return prompt_ids(tokenizer, prompt)
    return list(tokenizer.encode(prompt))


def encode_pair(tokenizer: Tokenizer, prompt: str, response: str) -> Example:
    """Prompt + response + EOS; the mask is 1 on the response and EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; a response could never end")
    head = prompt_tokens(tokenizer, prompt)
    tail = [int(i) for i in tokenizer(response, add_special_tokens=False)["input_ids"]]
    tail.append(int(tokenizer.eos_token_id))
    return head + tail, [0.0] * len(head) + [1.0] * len(tail)


def encode_messages(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Example | None:
    """A whole chat; the mask is 1 on the assistant turns. None when the template does not
    render the conversation's prefixes as prefixes of the whole (the spans are unknown)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            return None
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [1.0 if any(a <= s and e <= b and e > s for a, b in spans) else 0.0 for s, e in enc["offset_mapping"]]
    return [int(t) for t in enc["input_ids"]], mask


def _row_example(tokenizer: Tokenizer, row: Any) -> tuple[Example | None, str]:
    if not isinstance(row, dict):
        return None, f"expected an object, got {type(row).__name__}"
    msgs = row.get("messages")
    if msgs is not None:
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and isinstance(m.get("role"), str) for m in msgs):
            return None, "'messages' must be a list of {role, content} objects"
        if not any(m["role"] == "assistant" for m in msgs):
            return None, "'messages' has no assistant turn to learn"
        if not has_chat_template(tokenizer):
            return None, "'messages' rows need a model with a chat template"
        ex = encode_messages(tokenizer, msgs)
        return (ex, "") if ex is not None else (None, "the chat template does not render this chat prefix-stably")
    prompt, response = row.get("prompt"), row.get("response")
    if not isinstance(prompt, str) or not prompt.strip():
        return None, "'prompt' missing or empty"
    if not isinstance(response, str) or not response.strip():
        return None, "'response' missing or empty"
    return encode_pair(tokenizer, prompt, response), ""


def load_demonstrations(path: str, tokenizer: Tokenizer, max_seq_len: int) -> tuple[list[Example], Counter[str]]:
    """Every usable example of ``path`` and the refused rows by reason."""
    from realscale.data.dataset import DatasetError, read_jsonl, read_parquet

    if not os.path.isfile(path):
        raise DatasetError(f"SFT data file not found: {path}")
    rows = read_parquet(path) if path.endswith(".parquet") else read_jsonl(path)
    examples: list[Example] = []
    refused: Counter[str] = Counter()
    for _, row, error in rows:
        ex, why = (None, error.split(" (")[0]) if error else _row_example(tokenizer, row)
        if ex is not None and len(ex[0]) > max_seq_len:
            ex, why = None, f"longer than max_seq_len={max_seq_len} tokens"
        if ex is None:
            refused[why] += 1
        else:
            examples.append(ex)
    if not examples:
        raise DatasetError(f"{path}: no usable SFT example ({dict(refused)})")
    return examples, refused
