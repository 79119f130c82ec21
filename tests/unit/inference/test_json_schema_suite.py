"""Structured output on a suite of 32 JSON Schemas (objects, arrays, enums, nested objects,
numbers with bounds, patterns, required fields, unions): every constrained answer of the real
model, decoded greedily in one batch, parses and validates with ``jsonschema``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from aiserve.model_facts import read_model_facts
from services.inference.batch_engine import BatchEngine
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.grammar import Grammars, JsonConstraint
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest

SUITE = Path(__file__).parents[2] / "data" / "json_schemas.json"
MAX_NEW_TOKENS = 160


def chat(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids)


async def answer(engine: BatchEngine, request: GenerateRequest) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async with asyncio.timeout(300):
        async for event in engine.generate(request):
            ids.extend(event.token_ids)
            reason = event.finish_reason
    return ids, reason


async def test_every_answer_validates(model_dir: Path, two_torch_threads: None) -> None:
    cases: list[dict[str, Any]] = json.loads(SUITE.read_text(encoding="utf-8"))
    assert len(cases) >= 30
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = LlamaModel.load(model_dir, "cpu", torch.float32)
    eos = read_model_facts(model_dir).eos_token_ids
    engine = BatchEngine(model, eos, EngineConfig(512, SchedulerConfig(max_num_seqs=len(cases)),
                                                  KVCacheConfig(kv_cache_bytes=256 << 20, max_seq_len=512)),
                         Grammars(model_dir / "tokenizer.json", model.config.vocab_size, eos))
    engine.start()
    try:
        requests = [GenerateRequest(request_id=f"s{i}", max_new_tokens=MAX_NEW_TOKENS,
                                    prompt_token_ids=chat(tokenizer, f"{c['ask']} Reply with JSON only."),
                                    constraint=JsonConstraint(json.dumps(c["schema"])))
                    for i, c in enumerate(cases)]
        answers = await asyncio.gather(*(answer(engine, r) for r in requests))
    finally:
        await engine.stop()
    failures = []
    for case, (ids, reason) in zip(cases, answers, strict=True):
        text = tokenizer.decode(ids)
        try:
            jsonschema.validate(json.loads(text), case["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{case['ask']!r} -> {text!r} ({reason}): {exc}")
        else:
            assert reason == "stop", (case["ask"], text)  # the grammar ended it, not the length limit
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}])
def test_a_schema_the_compiler_refuses_is_an_error(model_dir: Path, schema: dict[str, Any]) -> None:
    from aiserve.common.errors import InvalidArgument

    grammars = Grammars(model_dir / "tokenizer.json", 49152, frozenset({2}))
    try:
        with pytest.raises(InvalidArgument, match="decoding.json_schema"):
            grammars.compile(JsonConstraint(json.dumps(schema))).result(timeout=60)
    finally:
        grammars.close()
