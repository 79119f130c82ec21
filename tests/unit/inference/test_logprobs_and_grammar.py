"""Log-probabilities and constrained decoding in the batching engine, on the real model (float32):
log-probabilities against a Hugging Face forward on the same ids, grammar masks that hold in a
mixed batch, drafts checked against the grammar, and the refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from aiserve.common.errors import InvalidArgument
from aiserve.model_facts import read_model_facts
from services.inference.batch_engine import BatchEngine
from services.inference.draft_planning import add_drafts
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.grammar import Grammars, JsonConstraint, RowGrammar
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest, TokenEvent
from services.inference.sampler import SamplingParams
from services.inference.scheduler_output import ScheduledChunk
from services.inference.sequence import Seq
from services.inference.speculative import NgramDrafter

TOLERANCE = 1e-4
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def loaded(model_dir: Path, two_torch_threads: None) -> LlamaModel:
    return LlamaModel.load(model_dir, "cpu", torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)


async def new_engine(loaded: LlamaModel, model_dir: Path, speculative: int = 2) -> BatchEngine:
    eos = read_model_facts(model_dir).eos_token_ids
    scheduler = SchedulerConfig(max_num_seqs=8, num_speculative_tokens=speculative)
    kv = KVCacheConfig(kv_cache_bytes=64 << 20, max_seq_len=512)
    engine = BatchEngine(loaded, eos, EngineConfig(256, scheduler, kv),
                         Grammars(model_dir / "tokenizer.json", loaded.config.vocab_size, eos))
    engine.start()
    return engine


@pytest.fixture
async def engine(loaded: LlamaModel, model_dir: Path) -> AsyncIterator[BatchEngine]:
    engine = await new_engine(loaded, model_dir)
    try:
        yield engine
    finally:
        await engine.stop()


def chat(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids)


async def collect(engine: BatchEngine, request: GenerateRequest) -> list[TokenEvent]:
    async with asyncio.timeout(60):
        return [event async for event in engine.generate(request)]


def reference_logprobs(hf: Any, prompt: tuple[int, ...], ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V]: the log-softmax over the next token before each of ``ids``, by transformers."""
    with torch.inference_mode():
        logits = hf(torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_logprobs_match(events: list[TokenEvent], reference: torch.Tensor, top: int) -> None:
    ids = [i for e in events for i in e.token_ids]
    logprobs = [lp for e in events for lp in e.logprobs]
    assert len(logprobs) == len(ids) == reference.shape[0]
    for step, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
        assert abs(lp.logprob - reference[step, token].item()) < TOLERANCE, step
        best = reference[step].topk(top)
        assert len(lp.top) == top
        for (got_id, got), want, want_id in zip(lp.top, best.values.tolist(), best.indices.tolist(), strict=True):
            assert abs(got - want) < TOLERANCE, step
            if abs(got - want) > 0 and got_id != want_id:  # ties may order either way
                assert abs(reference[step, got_id].item() - want) < TOLERANCE


async def test_greedy_logprobs_match_transformers(engine: BatchEngine, tokenizer: Tokenizer, hf: Any) -> None:
    # 14 random ids said three times: the model repeats them, so the n-gram drafter proposes
    # drafts, and the tokens of confirmed drafts carry logprobs too.
    phrase = torch.randint(3, 49152, (14,), generator=torch.Generator().manual_seed(6)).tolist()
    prompt = tuple(phrase * 3)
    events = await collect(engine, GenerateRequest(request_id="lp", prompt_token_ids=prompt, max_new_tokens=30,
                                                   top_logprobs=5, ignore_eos=True))
    ids = [i for e in events for i in e.token_ids]
    assert any(len(e.token_ids) > 1 for e in events), "no draft was confirmed: the draft rows went untested"
    assert_logprobs_match(events, reference_logprobs(hf, prompt, ids, 1.0), 5)


async def test_sampled_logprobs_are_after_temperature(engine: BatchEngine, tokenizer: Tokenizer, hf: Any) -> None:
    prompt = chat(tokenizer, "Name a fruit.")
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7)
    events = await collect(engine, GenerateRequest(request_id="t", prompt_token_ids=prompt, max_new_tokens=12,
                                                   params=params, top_logprobs=3))
    ids = [i for e in events for i in e.token_ids]
    # after temperature, before top-k/top-p: the full distribution, scaled
    assert_logprobs_match(events, reference_logprobs(hf, prompt, ids, 0.7), 3)


async def test_requests_that_do_not_ask_get_no_logprobs(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    prompt = chat(tokenizer, "Hi")
    plain, zero = await asyncio.gather(
        collect(engine, GenerateRequest(request_id="p", prompt_token_ids=prompt, max_new_tokens=6)),
        collect(engine, GenerateRequest(request_id="z", prompt_token_ids=prompt, max_new_tokens=6, top_logprobs=0)))
    assert all(e.logprobs == () for e in plain)
    assert [i for e in plain for i in e.token_ids] == [i for e in zero for i in e.token_ids]
    assert all(len(e.logprobs) == len(e.token_ids) and all(lp.top == () for lp in e.logprobs) for e in zero)


async def test_constrained_rows_follow_their_schema_in_a_mixed_batch(engine: BatchEngine,
                                                                     tokenizer: Tokenizer) -> None:
    free = GenerateRequest(request_id="f", prompt_token_ids=chat(tokenizer, "Tell me about Ada Lovelace."),
                           max_new_tokens=30)
    alone = [i for e in await collect(engine, free) for i in e.token_ids]
    prompt = chat(tokenizer, "Describe a person as JSON.")
    results = await asyncio.gather(
        collect(engine, GenerateRequest(request_id="s", prompt_token_ids=prompt, max_new_tokens=120,
                                        constraint=JsonConstraint(json.dumps(PERSON)), top_logprobs=2)),
        collect(engine, GenerateRequest(request_id="o", prompt_token_ids=prompt, max_new_tokens=200,
                                        constraint=JsonConstraint())),
        collect(engine, free))
    person = tokenizer.decode([i for e in results[0] for i in e.token_ids])
    jsonschema.validate(json.loads(person), PERSON)
    assert results[0][-1].finish_reason == "stop"
    assert all(lp.logprob > float("-inf") for e in results[0] for lp in e.logprobs)
    assert isinstance(json.loads(tokenizer.decode([i for e in results[1] for i in e.token_ids])), dict)
    assert [i for e in results[2] for i in e.token_ids] == alone  # the masks touched only their own rows
    assert engine.runner.masks.rows > 0


async def test_constrained_drafts_give_the_undrafted_answer(loaded: LlamaModel, model_dir: Path,
                                                            tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 12}}, "required": ["numbers"]}
    request = GenerateRequest(request_id="d", prompt_token_ids=chat(tokenizer, "List the numbers 1 to 12 as JSON."),
                              max_new_tokens=100, constraint=JsonConstraint(json.dumps(schema)))
    answers = []
    for speculative in (2, 0):
        engine = await new_engine(loaded, model_dir, speculative)
        try:
            answers.append([i for e in await collect(engine, request) for i in e.token_ids])
            if speculative:
                assert engine.stats().num_draft_tokens > 0, "no drafts were tried"
        finally:
            await engine.stop()
    assert answers[0] == answers[1]
    jsonschema.validate(json.loads(tokenizer.decode(answers[0])), schema)


def test_drafts_the_grammar_refuses_are_cut_before_the_step(model_dir: Path, tokenizer: Tokenizer) -> None:
    grammars = Grammars(model_dir / "tokenizer.json", 49152, frozenset({2}))
    try:
        compiled = grammars.compile(JsonConstraint(json.dumps(PERSON))).result(timeout=60)
    finally:
        grammars.close()
    prefix = tokenizer.encode('{"name": "Ada", "age": 3', add_special_tokens=False).ids
    # The sequence's own past holds the n-gram '"age": 3' followed by a letter: a draft JSON forbids here.
    past = tokenizer.encode(' x "age": 3x "age": 3x', add_special_tokens=False).ids
    seq = Seq([*past, *prefix[:-1]], len(past), 50)
    seq.grammar = RowGrammar(compiled, 4)
    seq.grammar.advance(prefix[:-1])
    seq.token_ids.append(prefix[-1])
    seq.grammar.advance(prefix[-1:])
    seq.drafter = NgramDrafter(min_ngram=1, max_ngram=4)
    proposed = NgramDrafter(min_ngram=1, max_ngram=4).propose(seq.token_ids, 4)
    chunks = [ScheduledChunk(seq, 0, len(seq.token_ids) - 1, (seq.token_ids[-1],), True)]
    add_drafts(chunks, 4, 16)
    kept = chunks[0].drafts
    assert proposed and len(kept) < len(proposed)
    assert kept == proposed[: len(kept)]
    assert RowGrammar(compiled, 4).valid_prefix(prefix) == len(prefix)


async def test_refusals_name_the_field(engine: BatchEngine, tokenizer: Tokenizer) -> None:
    prompt = chat(tokenizer, "Hi")
    with pytest.raises(InvalidArgument, match="top_logprobs: must be 0..20"):
        await collect(engine, GenerateRequest(request_id="a", prompt_token_ids=prompt, top_logprobs=21))
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        await collect(engine, GenerateRequest(request_id="b", prompt_token_ids=prompt, ignore_eos=True,
                                              constraint=JsonConstraint()))
    bad = JsonConstraint(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    for _ in range(2):  # compiled on the grammar thread, then refused from the cache
        with pytest.raises(InvalidArgument, match="decoding.json_schema"):
            await collect(engine, GenerateRequest(request_id="c", prompt_token_ids=prompt, constraint=bad))
    events = await collect(engine, GenerateRequest(request_id="d", prompt_token_ids=prompt, max_new_tokens=4))
    assert events[-1].finish_reason is not None  # the engine still serves
