"""ModelTokenizer against transformers' AutoTokenizer on the real model: ids, text, templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from aiserve.common.errors import InvalidArgument
from aiserve.store import Manifest
from services.tokenizer.tokenizer import ChatMessage, ModelTokenizer

CONVERSATIONS: dict[str, list[ChatMessage]] = {
    "user_only": [ChatMessage("user", "What is the capital of France?")],
    "with_system": [
        ChatMessage("system", "You answer in one word."),
        ChatMessage("user", "Capital of Japan?"),
    ],
    "multi_turn": [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi!"),
        ChatMessage("assistant", "Hello. How can I help?"),
        ChatMessage("user", "Translate 'cat' to Chinese: 猫? 🐱"),
    ],
    "assistant_last": [
        ChatMessage("user", "def f(x):\n    return x\n"),
        ChatMessage("assistant", "  It returns its argument.  "),
    ],
}


def _hf_chat(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(tokenizer: ModelTokenizer, hf_tokenizer: Any,
                                     corpus_text: str, add_special_tokens: bool) -> None:
    expected = hf_tokenizer(corpus_text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tokenizer.encode(corpus_text, add_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(tokenizer: ModelTokenizer, hf_tokenizer: Any,
                                     corpus_text: str, skip_special_tokens: bool) -> None:
    ids = tokenizer.encode(corpus_text)
    expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens) == expected


def test_decode_round_trip(tokenizer: ModelTokenizer, corpus_text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(corpus_text)) == corpus_text


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer: ModelTokenizer, hf_tokenizer: Any,
                                            name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        _hf_chat(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    text, ids = tokenizer.encode_chat(messages, add_generation_prompt)
    assert tokenizer.render_chat(messages, add_generation_prompt) == text == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        _hf_chat(messages), tokenize=True, add_generation_prompt=add_generation_prompt,
        return_dict=True)["input_ids"]
    assert ids == list(expected_ids)


def test_template_from_tokenizer_config(tmp_path: Path, model_dir: Path, manifest: Manifest,
                                        tokenizer: ModelTokenizer) -> None:
    """Without chat_template.jinja the template comes from tokenizer_config.json."""
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (model_dir / "chat_template.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    other = ModelTokenizer.from_folder(tmp_path, manifest)
    messages = CONVERSATIONS["multi_turn"]
    assert other.render_chat(messages) == tokenizer.render_chat(messages)


def test_info(tokenizer: ModelTokenizer, hf_tokenizer: Any, manifest: Manifest) -> None:
    info = tokenizer.info
    assert info.model == "smollm2-135m-instruct@0.1.2"
    assert info.tokenizer_sha256 == manifest.tokenizer_sha256
    assert info.vocab_size == len(hf_tokenizer) == 49152
    assert info.context_length == 8192
    assert hf_tokenizer.eos_token_id in info.eos_token_ids
    named = {t.name: (t.content, t.id) for t in info.special_tokens if t.name != "additional"}
    assert named == {"bos": ("<|im_start|>", 1), "eos": ("<|im_end|>", 2),
                     "pad": ("<|im_end|>", 2), "unk": ("<|endoftext|>", 0)}
    assert {t.id for t in info.special_tokens} == set(range(17))


def test_count(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.count(prompt="hello world") == 2
    messages = CONVERSATIONS["with_system"]
    assert tokenizer.count(messages=messages) == len(tokenizer.encode_chat(messages, True)[1])


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda t: t.encode(""), "text: must not be empty"),
        (lambda t: t.count(prompt=""), "prompt: must not be empty"),
        (lambda t: t.count(), "input: set one of prompt or chat"),
        (lambda t: t.decode([5, 49152]), "token_ids[1]: 49152 is outside [0, 49152)"),
        (lambda t: t.decode([-1]), "token_ids[0]: -1 is outside [0, 49152)"),
        (lambda t: t.render_chat([]), "messages: at least 1 message"),
        (lambda t: t.render_chat([ChatMessage("tool", "x")]),
         "messages[0].role: must be one of system, user, assistant, got 'tool'"),
        (lambda t: t.render_chat([ChatMessage("user", "a"), ChatMessage("assistant", "")]),
         "messages[1].content: must not be empty"),
        (lambda t: t.count(messages=[]), "chat.messages: at least 1 message"),
    ],
)
def test_validation_errors(tokenizer: ModelTokenizer, call: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        call(tokenizer)
    assert field in info.value.message


def test_decode_empty_ids(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.decode([]) == ""
