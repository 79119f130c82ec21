"""xgrammar vs llguidance on this CPU, for this model's vocabulary: grammar compile time for a
few JSON schemas and token-mask time per decoding step (the choice in docs/decisions.md).

    python -m bench.grammar_libs [--model-dir DIR] [--steps N]

Prints one JSON object. Times are wall-clock on a shared machine: compare the two libraries
within one run, not against other runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from transformers import AutoTokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "enum_array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1},
        "score": {"type": "number"}}, "required": ["colors", "score"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}}}, "required": ["id", "tags"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
}
# A JSON text to walk the grammar with, token by token, for each schema.
WALKS = {
    "flat": '{"name": "Ada Lovelace", "age": 36}',
    "enum_array": '{"colors": ["red", "blue", "green"], "score": 9.5}',
    "nested": '{"user": {"id": 7, "tags": ["a", "bee", "sea"]}, "active": true}',
}


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3}


def _xgrammar(tokenizer: Any, vocab: int) -> dict[str, Any]:
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        compile_s = time.perf_counter() - started
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        masks: list[float] = []
        for token in tokenizer.encode(WALKS[name], add_special_tokens=False):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - started)
            assert matcher.accept_token(token), (name, token)
        out[name] = {"compile_ms": compile_s * 1e3, "steps": len(masks), **_ms(masks)}
    return out


def _llguidance(tokenizer: Any, vocab: int) -> dict[str, Any]:
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        compile_s = time.perf_counter() - started
        assert not matcher.get_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        masks: list[float] = []
        for token in tokenizer.encode(WALKS[name], add_special_tokens=False):
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            masks.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        out[name] = {"compile_ms": compile_s * 1e3, "steps": len(masks), **_ms(masks)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path,
                        default=Path("var/models/smollm2-135m-instruct/0.1.2"))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    vocab = len(tokenizer)
    torch.set_num_threads(1)
    print(json.dumps({"vocab": vocab, "xgrammar": _xgrammar(tokenizer, vocab),
                      "llguidance": _llguidance(tokenizer, vocab)}, indent=1))


if __name__ == "__main__":
    main()
