"""The model's tokenizer: text <-> token ids, chat template, special tokens, context length.

Core code: no gRPC and no pb here. Encoding and decoding go through the ``tokenizers`` library
on the model's own ``tokenizer.json``; chat templates are rendered with jinja2 exactly as
Hugging Face transformers renders them, so ids and prompts match ``AutoTokenizer`` bit for bit.
Caller mistakes raise ``InvalidArgument`` with a message naming the field and the limit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from aiserve.common.errors import FailedPrecondition, InvalidArgument
from aiserve.common.protocol import CHAT_ROLES
from aiserve.model_facts import TOKENIZER_FILE, ModelFactsError, decoder_kinds, read_model_facts, token_text
from aiserve.store import Manifest, ModelStoreError

_NAMED_SPECIALS = ("bos", "eos", "pad", "unk")
# Keys of tokenizer_config.json that list further special tokens (transformers 4.x / 5.x).
_EXTRA_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")


MAX_TOKEN_BYTES_IDS = 4096
"""The most ids one TokenBytes call may ask for."""

@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation; ``role`` is one of ``ROLES``."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SpecialToken:
    """A special token: its role ("bos", "eos", "pad", "unk", "additional"), text and id."""

    name: str
    content: str
    id: int


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What the tokenizer is: model, fingerprint, vocabulary, special tokens, context length."""

    model: str
    tokenizer_sha256: str
    vocab_size: int
    special_tokens: tuple[SpecialToken, ...]
    context_length: int
    eos_token_ids: tuple[int, ...]


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; transformers overrides it the same way.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (sandboxed, trimmed)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _special_tokens(tok: Tokenizer, tokenizer_config: dict[str, Any]) -> tuple[SpecialToken, ...]:
    """bos/eos/pad/unk from tokenizer_config.json, then every other special token, by id."""
    found: list[SpecialToken] = []
    for name in _NAMED_SPECIALS:
        text = token_text(tokenizer_config.get(f"{name}_token"))
        if text is not None and (token_id := tok.token_to_id(text)) is not None:
            found.append(SpecialToken(name, text, token_id))
    extra = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for key in _EXTRA_SPECIAL_KEYS:
        for value in tokenizer_config.get(key) or ():
            text = token_text(value)
            if text is not None and (token_id := tok.token_to_id(text)) is not None:
                extra[token_id] = text
    named_ids = {t.id for t in found}
    found += [SpecialToken("additional", text, i) for i, text in sorted(extra.items())
              if i not in named_ids]
    return tuple(found)


class ModelTokenizer:
    """Text <-> token ids and chat rendering for one model version; thread-safe, stateless."""

    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo,
                 template: jinja2.Template | None, template_vars: dict[str, str]) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._template_vars = template_vars  # bos_token, eos_token, ... as the template sees them
        self.info = info

    @classmethod
    def from_folder(cls, folder: Path, manifest: Manifest) -> ModelTokenizer:
        """Load from a (verified) model store folder; malformed files raise ModelStoreError."""
        ref = str(manifest.ref)
        try:
            facts = read_model_facts(folder)
        except ModelFactsError as exc:
            raise ModelStoreError(f"model {ref}: {exc}") from exc
        tok = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        specials = _special_tokens(tok, facts.tokenizer_config)
        info = TokenizerInfo(
            model=ref,
            tokenizer_sha256=manifest.tokenizer_sha256,
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            special_tokens=specials,
            context_length=facts.context_length,
            eos_token_ids=tuple(sorted(facts.eos_token_ids)),
        )
        source = facts.chat_template
        try:
            template = compile_chat_template(source) if source is not None else None
        except jinja2.TemplateSyntaxError as exc:
            raise ModelStoreError(f"model {ref}: chat template does not compile: {exc}") from exc
        template_vars = {f"{t.name}_token": t.content for t in specials if t.name != "additional"}
        return cls(tok, info, template, template_vars)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False, field: str = "text") -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the model's post-processor."""
        if not text:
            raise InvalidArgument(f"{field}: must not be empty (at least 1 character)")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def check_ids(self, ids: Sequence[int], field: str = "token_ids") -> None:
        """Raise InvalidArgument naming the first id outside [0, vocab_size)."""
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgument(
                    f"{field}[{index}]: {token_id} is outside [0, {self.vocab_size})")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (an empty list gives ""); bad ids raise InvalidArgument."""
        self.check_ids(ids)
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, ids: Sequence[int], field: str = "token_ids") -> list[bytes]:
        """The bytes each id stands for alone (a byte-level piece may be part of a character)."""
        if len(ids) > MAX_TOKEN_BYTES_IDS:
            raise InvalidArgument(f"{field}: at most {MAX_TOKEN_BYTES_IDS} ids, got {len(ids)}")
        self.check_ids(ids, field)
        table = self._bytes_table
        return [table[i] for i in ids]

    @functools.cached_property
    def _bytes_table(self) -> list[bytes]:
        """Every id's bytes, built on first use: byte-level BPE pieces map back through GPT-2's
        byte-to-character table; added tokens and other vocabularies are their decoded text."""
        tok = self._tokenizer
        kinds = decoder_kinds(tok.to_str())
        added = {i for i in tok.get_added_tokens_decoder()}
        byte_of = {c: b for b, c in _byte_level_chars().items()}
        table = []
        for i in range(self.vocab_size):
            piece = tok.id_to_token(i) or ""
            if "ByteLevel" in kinds and i not in added and all(c in byte_of for c in piece):
                table.append(bytes(byte_of[c] for c in piece))
            else:
                table.append(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        return table

    def decode_unchecked(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """``decode`` for ids already checked (the incremental detokenizer's hot path)."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    field: str = "messages") -> str:
        """The prompt text of a conversation, rendered with the model's chat template."""
        _check_messages(messages, field)
        if self._template is None:
            raise FailedPrecondition(f"model {self.info.model} has no chat template")
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(messages=plain, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._template_vars)
        except jinja2.TemplateError as exc:  # raise_exception(...) inside the template
            raise InvalidArgument(f"{field}: rejected by the chat template: {exc}") from exc

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    field: str = "messages") -> tuple[str, list[int]]:
        """Rendered prompt and its ids (the template already holds the special tokens)."""
        text = self.render_chat(messages, add_generation_prompt, field)
        return text, list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, prompt: str | None = None, messages: Sequence[ChatMessage] | None = None) -> int:
        """Tokens of a raw prompt (with the post-processor's special tokens, as generation
        tokenizes it) or of a chat rendered with the generation prompt."""
        if prompt is not None:
            return len(self.encode(prompt, add_special_tokens=True, field="prompt"))
        if messages is not None:
            return len(self.encode_chat(messages, True, field="chat.messages")[1])
        raise InvalidArgument("input: set one of prompt or chat")


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE pieces are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _check_messages(messages: Sequence[ChatMessage], field: str) -> None:
    if not messages:
        raise InvalidArgument(f"{field}: at least 1 message is required, got 0")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"{field}[{index}].role: must be one of {', '.join(CHAT_ROLES)}, "
                                  f"got {message.role!r}")
        if not message.content:
            raise InvalidArgument(f"{field}[{index}].content: must not be empty "
                                  "(at least 1 character)")
