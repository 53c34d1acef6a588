"""A Hugging Face tokenizer's behaviour without importing transformers.

Importing transformers costs ~1-1.5 s of CPU per process (its ``utils`` package, the
import-structure scan of every model family), and a run pays it in the processes that only
encode prompts and decode answers: each generation server and each rollout process. On a
2-core machine that is seconds of a run's start-up (BENCHMARKS.md, "Start-up and
checkpoints inside the loop").

What a *fast* Hugging Face tokenizer (``TokenizersBackend``, transformers 5) does for those
calls is the ``tokenizers`` library's work plus a thin wrapper:

- ``encode`` / ``__call__``: ``backend.encode_batch([text], add_special_tokens=...)`` with
  truncation and padding off and ``encode_special_tokens`` set from ``split_special_tokens``
  (transformers 5.19 ``tokenization_utils_tokenizers.py``: ``_encode_plus`` 1043-1055 and
  ``set_truncation_and_padding`` 919-946);
- ``decode``: ``backend.decode(ids, skip_special_tokens=...)`` (``_decode`` 1122-1135; the
  clean-up step after it is off for the tokenizers snapshotted here, see below);
- ``apply_chat_template``: the chat template rendered by jinja2 in an immutable sandbox with
  ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
  tag, a ``tojson`` filter that does not escape HTML and the ``raise_exception`` and
  ``strftime_now`` globals, with the tokenizer's special-tokens map as variables
  (``utils/chat_template_utils.py`` 426-501, ``tokenization_utils_base.py`` 3108-3118).

:class:`LightTokenizer` does exactly that from a *snapshot* of a loaded Hugging Face
tokenizer (:func:`snapshot_of`): its backend serialised as the backend it really uses (after
whatever its class's constructor changed), its chat template, special tokens and flags. The
snapshot is taken only of tokenizers whose class changes none of these calls and whose
decode has no clean-up step (:func:`snapshot_of` returns None otherwise); for anything else
callers get the Hugging Face tokenizer itself (:func:`realscale.models.tokenizer.load_light_tokenizer`).
It offers the calls realscale's servers and rollouts make (:class:`realscale.data.tokens.Tokenizer`);
options beyond them (offsets, tensors, padding, batches, ``continue_final_message``) raise,
naming the option, rather than being ignored.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SNAPSHOT_VERSION = 1
# What TokenizersBackend defines and a subclass must not redefine for the snapshot to stand
# in for it (checked by name along the class's MRO).
_WRAPPER_CALLS = ("__call__", "encode", "_encode_plus", "decode", "_decode", "batch_decode", "apply_chat_template",
                  "get_chat_template", "set_truncation_and_padding", "convert_tokens_to_ids", "tokenize")


def snapshot_of(tok: "PreTrainedTokenizerBase") -> dict[str, Any] | None:
    """What :class:`LightTokenizer` needs of a loaded Hugging Face tokenizer, or None when
    it could not reproduce the tokenizer's calls (not a ``TokenizersBackend``, a class that
    overrides one of its encode/decode/template calls, or a decode with clean-up)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tok)
    if not isinstance(tok, TokenizersBackend):
        return None
    for klass in cls.__mro__:
        if klass is TokenizersBackend:
            break
        if any(name in vars(klass) for name in _WRAPPER_CALLS):
            return None
    if getattr(tok, "clean_up_tokenization_spaces", False):
        return None
    template = getattr(tok, "chat_template", None)
    if template is not None and not isinstance(template, (str, dict)):
        return None
    return {"version": SNAPSHOT_VERSION, "class": f"{cls.__module__}:{cls.__qualname__}",
            "backend": tok.backend_tokenizer.to_str(), "chat_template": template,
            "special_tokens_map": dict(tok.special_tokens_map), "split_special_tokens": bool(tok.split_special_tokens),
            "ids": {name: getattr(tok, f"{name}_token_id") for name in ("eos", "bos", "pad", "unk")}}


class LightTokenizer:
    """A Hugging Face fast tokenizer's encode, decode and chat template, from its snapshot."""

    def __init__(self, snapshot: dict[str, Any], name_or_path: str = "") -> None:
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"tokenizer snapshot of version {snapshot.get('version')!r}, expected {SNAPSHOT_VERSION}")
        self._backend = Tokenizer.from_str(snapshot["backend"])
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = bool(snapshot["split_special_tokens"])
        self.chat_template: str | dict[str, str] | None = snapshot["chat_template"]
        self.special_tokens_map: dict[str, Any] = dict(snapshot["special_tokens_map"])
        ids = snapshot["ids"]
        self.eos_token_id: int | None = ids.get("eos")
        self.bos_token_id: int | None = ids.get("bos")
        self.pad_token_id: int | None = ids.get("pad")
        self.unk_token_id: int | None = ids.get("unk")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.hf_class = snapshot["class"]
        self.name_or_path = name_or_path
        self._templates: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"LightTokenizer({self.name_or_path!r}, as {self.hf_class})"

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, **options: Any) -> list[int]:
        _refuse(options, "encode")
        if not isinstance(text, str):
            raise TypeError(f"LightTokenizer.encode takes one string, got {type(text).__name__}")
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __call__(self, text: str, add_special_tokens: bool = True, **options: Any) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens, **options)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Any, skip_special_tokens: bool = False, **options: Any) -> str:
        _refuse(options, "decode")
        if isinstance(ids, int):
            ids = [ids]
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, str]] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> Any:
        """``conversation`` (one list of messages) rendered by the chat template; with
        ``tokenize``, its ids (in a dict with ``return_dict``, as transformers 5 returns them)."""
        for option in ("continue_final_message", "return_assistant_tokens_mask", "padding", "truncation",
                       "max_length", "return_tensors", "tokenizer_kwargs"):
            if kwargs.get(option):
                raise TypeError(f"LightTokenizer.apply_chat_template: {option} is not supported; load the full "
                                "tokenizer (realscale.models.tokenizer.load_tokenizer)")
            kwargs.pop(option, None)
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("apply_chat_template: give one non-empty list of messages")
        if isinstance(conversation[0], (list, tuple)):
            raise TypeError("LightTokenizer.apply_chat_template renders one conversation at a time")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise TypeError("LightTokenizer.apply_chat_template: give tools as JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        template = self._template(self._template_source(chat_template, tools))
        text = template.render(messages=list(conversation), tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _template_source(self, chat_template: str | None, tools: Any) -> str:
        """The template text: ``chat_template`` (a template, or the name of one of the
        tokenizer's), else the tokenizer's (``tool_use`` with tools, else ``default``)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"this tokenizer has several chat templates ({sorted(own)}) and none named 'default': "
                             "pass chat_template=<name>")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template "
                             "(tokenizer_config.json or chat_template.jinja): pass chat_template=")
        return own

    def _template(self, source: str) -> Any:
        if source not in self._templates:
            self._templates[source] = _environment().from_string(source)
        return self._templates[source]


def _refuse(options: dict[str, Any], call: str) -> None:
    """Options that change a result and are not reproduced here: refused by name (a falsy
    value asks for the default, which is what happens)."""
    given = sorted(k for k, v in options.items() if v)
    if given:
        raise TypeError(f"LightTokenizer.{call}: {', '.join(given)} not supported; load the full tokenizer "
                        "(realscale.models.tokenizer.load_tokenizer)")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses the tag
    to mark assistant tokens for a mask this tokenizer does not return)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON without jinja2's HTML escaping (what chat templates expect of ``tojson``)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV: ImmutableSandboxedEnvironment | None = None


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates are rendered in (the settings transformers
    renders them with; see the module docstring), made once."""
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV
