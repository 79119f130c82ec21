"""Facts of a model-store folder that more than one service relies on, read by one set of rules.

The tokenizer service reports the EOS ids and the context length, the inference service stops
sequences at the EOS ids and sizes its KV slots by the context length, and the gateway pairs
the two only if they agree; so both read them here, from the same files, the same way. Plain
JSON reading: no torch, no tokenizers library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# config.json keys that give the context length, most common first.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


class ModelFactsError(ValueError):
    """A folder lacks a fact the services need (e.g. no context length in config.json)."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the services agree on about one model folder."""

    eos_token_ids: frozenset[int]
    """Ids that end a generation: config.json's and generation_config.json's ``eos_token_id``
    (one id or a list) and the id of tokenizer_config.json's ``eos_token``, merged."""
    context_length: int
    """Tokens of prompt + output the model was trained for (the first of ``CONTEXT_KEYS``)."""
    chat_template: str | None
    """The chat template's Jinja source (chat_template.jinja, else tokenizer_config.json's
    ``chat_template``: a string, or the template named "default" of a list); None = none."""
    tokenizer_config: dict[str, Any]
    """tokenizer_config.json as written (special-token names, for the tokenizer service)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when the file is absent."""
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def decoder_kinds(tokenizer_json: str) -> frozenset[str]:
    """The decoder types of a tokenizer.json (its decoder and, for a Sequence, each step's):
    "ByteLevel" means GPT-2 style pieces, bytes spelled as printable characters."""
    decoder = json.loads(tokenizer_json).get("decoder") or {}
    return frozenset(str(d.get("type")) for d in [decoder, *decoder.get("decoders", [])] if d.get("type"))


def token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def as_ids(value: object) -> set[int]:
    """An ``eos_token_id`` setting: absent, one id or a list of ids."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def token_id(tokenizer: dict[str, Any], text: str) -> int | None:
    """The id of ``text`` in a parsed tokenizer.json: added tokens first, then the vocabulary."""
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == text:
            return int(added["id"])
    vocab = tokenizer.get("model", {}).get("vocab")
    return int(vocab[text]) if isinstance(vocab, dict) and text in vocab else None


def context_length(model_config: dict[str, Any]) -> int | None:
    """The first positive of ``CONTEXT_KEYS`` in a parsed config.json; None when none is set."""
    for key in CONTEXT_KEYS:
        if isinstance(value := model_config.get(key), int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def chat_template_source(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's "chat_template" (a string or named list)."""
    if (path := folder / CHAT_TEMPLATE_FILE).is_file():
        return path.read_text(encoding="utf-8")
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


def read_model_facts(folder: Path) -> ModelFacts:
    """The facts of a (verified) model folder; ModelFactsError when config.json has no context length."""
    model_config = read_json(folder / CONFIG_FILE)
    tokenizer_config = read_json(folder / TOKENIZER_CONFIG_FILE)
    ids = as_ids(model_config.get("eos_token_id"))
    ids |= as_ids(read_json(folder / GENERATION_CONFIG_FILE).get("eos_token_id"))
    eos = token_text(tokenizer_config.get("eos_token"))
    if eos is not None and (found := token_id(read_json(folder / TOKENIZER_FILE), eos)) is not None:
        ids.add(found)
    length = context_length(model_config)
    if length is None:
        raise ModelFactsError(f"{folder / CONFIG_FILE}: has none of {', '.join(CONTEXT_KEYS)}")
    return ModelFacts(frozenset(ids), length, chat_template_source(folder, tokenizer_config), tokenizer_config)
