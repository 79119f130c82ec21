"""Fixtures of the tokenizer tests: the real model's tokenizer, a multilingual corpus, and the
service on a real gRPC socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from grpc import aio

from aiserve.common.server import ServiceHandle
from aiserve.store import Manifest, ModelStore
from aiserve.v1 import tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import create_server
from services.tokenizer.tokenizer import ModelTokenizer

TIMEOUT_S = 10.0
"""Deadline of each call to the service under test."""
MODEL = "smollm2-135m-instruct@0.1.2"
CHINESE = "你好，世界！我们去公园散步吧。🙂"
Stub = tokenizer_pb2_grpc.TokenizerStub

# Text that stresses byte-level BPE: scripts, multi-byte characters, emoji sequences, code,
# whitespace runs and literal special-token text.
CORPUS: dict[str, str] = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "english_long": " ".join(["Serving models at scale needs continuous batching."] * 40),
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。机器学习模型需要大量数据。",
    "japanese_korean": "東京は日本の首都です。 안녕하세요, 만나서 반갑습니다.",
    "arabic_hindi": "مرحبا بالعالم — नमस्ते दुनिया",
    "emoji": "🙂 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🧑🏿‍💻",
    "code": 'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b  # ok\n\n'
            "if __name__ == '__main__':\n\tprint({'x': [1, 2, 3]})\n",
    "mixed": "Price: 42€ (≈ ¥330) — naïve café 😀; 中文 mixed with English; ∑ x² = ∞",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353",
    "whitespace_edges": "  leading and trailing spaces  ",
    "newlines": "line one\n\n\nline two\r\nline three\n",
    "tabs_and_spaces": "\t\t  \t x \u00a0\u3000y",
    "only_spaces": "     ",
    "single_char": "a",
    "special_text": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "rare_chars": "\U0001f600\U0001f4a9\U00020000\U0002a6d6 \u2028 \ufeff",
}

# Texts whose characters span several bytes (and so several byte-level tokens).
WIDE = ("chinese", "japanese_korean", "emoji", "mixed", "rare_chars", "arabic_hindi")


@pytest.fixture(scope="session")
def tokenizer(store: ModelStore, model_dir: Any, manifest: Manifest) -> ModelTokenizer:
    return ModelTokenizer.from_folder(model_dir, manifest)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Any) -> Any:
    """transformers' own tokenizer of the same folder: the reference the service must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(params=sorted(CORPUS), ids=str)
def corpus_text(request: pytest.FixtureRequest) -> str:
    return CORPUS[request.param]


@pytest.fixture(params=WIDE, ids=str)
def wide_text(request: pytest.FixtureRequest) -> str:
    return CORPUS[request.param]


# One server per test module (and its event loop): loading verifies ~0.5 GB of model hashes.
@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(store: ModelStore) -> AsyncIterator[ServiceHandle]:
    config = TokenizerConfig(port=0, metrics_port=0, model_store=str(store.root))
    handle = await create_server(config)
    try:
        await handle.start()
        await handle.set_serving(True)
        yield handle
    finally:
        await handle.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server: ServiceHandle) -> AsyncIterator[Stub]:
    async with aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)
