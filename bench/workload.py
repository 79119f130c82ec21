"""The engine benchmark's requests: prompts that ask for long answers, rendered the way the
gateway renders them, and arrivals spread over time."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

TOPICS = ["rivers", "mountains", "the ocean", "volcanoes", "forests", "deserts", "the moon", "glaciers",
          "bridges", "castles", "trains", "gardens", "bees", "whales", "storms", "libraries"]

def prompts(n: int) -> list[str]:
    """``n`` requests for long essays (greedy answers run to max_new_tokens or a late EOS)."""
    return [f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]} (part {i // len(TOPICS) + 1})."
            for i in range(n)]


def chat_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``text`` as one user message, rendered with the chat template and tokenized, as the
    gateway sends it to the inference service."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok.encode(str(rendered), add_special_tokens=False))


@dataclass
class Arrival:
    """One request of a workload: when it arrives (seconds from the start), its text and ids,
    and its max_new_tokens."""

    at_s: float
    text: str
    prompt_ids: list[int]
    max_new: int
