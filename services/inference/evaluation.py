"""What ``aiserve eval`` measures of one version, and how two versions' measures compare.

A version is loaded with the service's own model code, in the precision the service would pick
on this machine (a quantized version in its own dtype: ``LlamaModel.load``), and run in-process
(``offline.OfflineModel``):

- over a text: the log-probabilities of every next token (perplexity = exp of their mean
  negative log-likelihood);
- on the tasks: greedy answers, each prompt one user message through the chat template.

Between a reference and a candidate over the same text: KL(reference || candidate) of the
next-token distributions per position, and how often their top-1 tokens agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from aiserve.common.cpu import read_cpu_flags
from aiserve.eval_tasks import Task
from aiserve.model_facts import read_model_facts
from aiserve.store import Manifest
from services.inference.llama import LlamaModel
from services.inference.model import TORCH_DTYPES
from services.inference.offline import OfflineModel
from services.inference.precision import AUTO, choose_precision
from services.tokenizer.tokenizer import ChatMessage, ModelTokenizer


@dataclass(frozen=True)
class VersionRun:
    """One version's outputs: log-probabilities over the text and answers to the tasks."""

    log_probs: torch.Tensor  # [n-1, V] float32: the distribution after each token but the last
    targets: torch.Tensor  # [n-1] the tokens that followed
    answers: list[str]
    dtype: str

    @property
    def perplexity(self) -> float:
        nll = -self.log_probs.gather(1, self.targets[:, None]).mean()
        return math.exp(float(nll))


@dataclass(frozen=True)
class TextComparison:
    """How a candidate's next-token distributions differ from a reference's over one text."""

    kl_per_token: list[float]  # KL(reference || candidate) in nats, per position
    top1_agreement: float

    @property
    def kl_mean(self) -> float:
        return sum(self.kl_per_token) / len(self.kl_per_token)

    @property
    def kl_max(self) -> float:
        return max(self.kl_per_token)


def load_version(folder: Path) -> LlamaModel:
    """The version in ``folder`` as the service would run it on this machine (CPU, "auto")."""
    precision = choose_precision("cpu", read_cpu_flags(), AUTO, AUTO)
    return LlamaModel.load(folder, "cpu", TORCH_DTYPES[precision.weights], TORCH_DTYPES[precision.matmul])


def run_version(folder: Path, manifest: Manifest, text: str, tasks: Sequence[Task], max_text_tokens: int,
                max_new_tokens: int, kv_dtype: str = "auto") -> VersionRun:
    """Load the version and run it over the text (its first ``max_text_tokens`` tokens) and the
    tasks (greedy, at most ``max_new_tokens`` each), on a KV cache stored as ``kv_dtype``."""
    tokenizer = ModelTokenizer.from_folder(folder, manifest)
    model = OfflineModel(load_version(folder), kv_dtype)
    ids = tokenizer.encode(text)[:max_text_tokens]
    log_probs = torch.log_softmax(model.text_logits(ids)[:-1], dim=-1)
    prompts = [tokenizer.encode_chat([ChatMessage("user", t.prompt)])[1] for t in tasks]
    eos = read_model_facts(folder).eos_token_ids
    answers = [tokenizer.decode(a, skip_special_tokens=True).strip()
               for a in model.greedy(prompts, max_new_tokens, eos)]
    return VersionRun(log_probs, torch.tensor(ids[1:]), answers, str(model.model.dtype).removeprefix("torch."))


def compare_text(reference: VersionRun, candidate: VersionRun) -> TextComparison:
    """KL(reference || candidate) per position and top-1 agreement over the same text."""
    if not torch.equal(reference.targets, candidate.targets):
        raise ValueError("the two versions tokenized the text differently: their tokenizers differ")
    p_ref = reference.log_probs.exp()
    kl = (p_ref * (reference.log_probs - candidate.log_probs)).sum(dim=-1).clamp_min(0.0)
    agree = (reference.log_probs.argmax(-1) == candidate.log_probs.argmax(-1)).float().mean()
    return TextComparison(kl.tolist(), float(agree))
