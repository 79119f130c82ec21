"""A small random Llama stored as a real store version, with the default model's tokenizer files:
the quantize and eval tests run the whole path (store, verification, loading, forward,
tokenizer, chat template) in seconds instead of minutes."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from aiserve.store import ModelRef, ModelStore

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_version(store: ModelStore, model_dir: Path, work: Path, version: str = "1", seed: int = 0) -> ModelRef:
    """Install ``tiny@version``: 2 layers of width 64 over the default model's vocabulary."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    folder = work / f"tiny-{version}"
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, folder / name)
    ref = ModelRef("tiny", version)
    store.install(ref, folder, {"test": "random tiny Llama"})
    return ref
