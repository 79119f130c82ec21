"""The sampler: each parameter's effect, measured over many seeded draws on fixed logits."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from aiserve.common.errors import InvalidArgument
from services.inference.sampler import SamplingParams, new_generator, sample

# Fixed synthetic logits, already sorted: id 0 is the most likely, id 7 the least.
LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
DRAWS = 4000
CPU = torch.device("cpu")


def draw(params: SamplingParams, seen: list[int] | None = None, n: int = DRAWS) -> list[int]:
    """``n`` independent draws: a batch of ``n`` identical rows, row i seeded with i."""
    rows = [SamplingParams(params.temperature, params.top_p, params.top_k,
                           params.repetition_penalty, seed=i) for i in range(n)]
    generators = [new_generator(p, CPU) for p in rows]
    ids = sample(LOGITS.expand(n, -1), rows, generators, [seen or []] * n)
    return [int(i) for i in ids]


def entropy(ids: list[int]) -> float:
    counts = Counter(ids)
    return -sum(c / len(ids) * math.log(c / len(ids)) for c in counts.values())


def test_greedy_is_argmax_of_every_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    params = [SamplingParams(temperature=0.0)] * 16
    ids = sample(logits, params, [None] * 16, [[]] * 16)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled_row", [False, True])
def test_greedy_takes_the_first_of_tied_maxima(dtype: torch.dtype, sampled_row: bool) -> None:
    """Ties (common in bf16, whose logits have 8 bits of mantissa) go to the lowest id, like
    torch.argmax, whether the batch is all greedy (argmax in the logits' dtype) or not."""
    torch.manual_seed(0)
    logits = torch.randn(8, 50_000).to(dtype)
    for row, ids in enumerate([(7, 8), (40_000, 3), (12, 49_999, 30_000)]):
        logits[row, list(ids)] = 9.0
    params = [SamplingParams(temperature=0.0)] * 8
    generators: list[torch.Generator | None] = [None] * 8
    if sampled_row:
        params[7] = SamplingParams(temperature=1.0, seed=3)
        generators[7] = new_generator(params[7], CPU)
    ids = sample(logits, params, generators, [[]] * 8).tolist()
    assert ids[:3] == [7, 3, 12]
    assert ids[:7] == logits.float().argmax(dim=-1).tolist()[:7]


def test_logits_are_not_modified() -> None:
    logits = LOGITS.clone()[None, :]
    sample(logits, [SamplingParams(1.0, 0.5, 3, 1.5, seed=1)], [new_generator(
        SamplingParams(1.0, seed=1), CPU)], [[0, 1]])
    assert torch.equal(logits[0], LOGITS)


def test_lower_temperature_concentrates_and_higher_flattens() -> None:
    cold = entropy(draw(SamplingParams(temperature=0.3)))
    normal = entropy(draw(SamplingParams(temperature=1.0)))
    hot = entropy(draw(SamplingParams(temperature=2.0)))
    assert cold < normal < hot
    # At T=1 the empirical frequencies follow softmax(logits).
    expected = torch.softmax(LOGITS, dim=-1)[0].item()
    assert abs(Counter(draw(SamplingParams(temperature=1.0)))[0] / DRAWS - expected) < 0.03


def test_top_k_never_samples_outside_the_k_best() -> None:
    ids = draw(SamplingParams(temperature=2.0, top_k=3))
    assert set(ids) == {0, 1, 2}


def test_top_p_never_samples_outside_the_nucleus() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    # Smallest prefix holding >= 0.8 of the mass (LOGITS are sorted).
    size = int((torch.cumsum(probs, dim=-1) < 0.8).sum()) + 1
    ids = draw(SamplingParams(temperature=1.0, top_p=0.8))
    assert set(ids) == set(range(size))
    assert size < len(LOGITS)


def test_tiny_top_p_keeps_at_least_the_best_id() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_p=1e-6))) == {0}


def test_repetition_penalty_lowers_the_frequency_of_seen_ids() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    plain = Counter(draw(SamplingParams(temperature=1.0), seen=[0, 6]))
    penalised = Counter(draw(params, seen=[0, 6]))
    assert penalised[0] < plain[0] * 0.8  # positive logit: divided by the penalty
    assert penalised[6] < plain[6]  # negative logit: multiplied by the penalty
    assert penalised[1] > plain[1]  # unseen ids gain the mass


def test_repetition_penalty_applies_to_greedy_rows() -> None:
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert sample(LOGITS[None, :], params, [None], [[0]]).tolist() == [1]


def seeded_sequence(seed: int, others: list[SamplingParams], steps: int = 40) -> list[int]:
    """The ids row 0 (seeded) draws over ``steps`` calls while ``others`` share the batch."""
    rows = [SamplingParams(temperature=1.2, top_p=0.95, seed=seed), *others]
    generators = [new_generator(p, CPU) for p in rows]
    logits = LOGITS.expand(len(rows), -1)
    return [int(sample(logits, rows, generators, [[]] * len(rows))[0]) for _ in range(steps)]


def test_same_seed_same_draws_whatever_else_is_in_the_batch() -> None:
    alone = seeded_sequence(42, [])
    crowded = seeded_sequence(42, [SamplingParams(temperature=0.7, top_k=4),
                                   SamplingParams(temperature=0.0),
                                   SamplingParams(temperature=1.5, repetition_penalty=1.3)])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ() -> None:
    assert seeded_sequence(1, []) != seeded_sequence(2, [])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=2.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=10**6), "top_k"),
        (SamplingParams(repetition_penalty=3.0), "repetition_penalty"),
    ],
)
def test_out_of_range_parameters_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        params.validate(vocab_size=49152)


def test_drawing_among_the_best_ids_picks_what_sorting_the_whole_row_picks() -> None:
    """Rows of a 5,000-id vocabulary, peaked and flat, under each cut: the draw decided among
    the CANDIDATES best ids (or sorted where it falls past them) is the sorted draw's, uniform
    for uniform, and both paths are taken."""
    from services.inference.sampler import CANDIDATES, _draw_from_best, _draw_sorted, _sample_rows

    rng = torch.Generator().manual_seed(7)
    vocab, n = 5000, 64
    peaked = torch.randn(n, vocab, generator=rng) * 4
    flat = torch.randn(n, vocab, generator=rng) * 0.1
    cuts = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=1.2, top_k=40), SamplingParams(temperature=0.7, top_k=CANDIDATES + 100),
            SamplingParams(temperature=2.0, top_p=0.5, top_k=1000)]
    for logits in (peaked, flat):
        for cut in cuts:
            rows = [SamplingParams(cut.temperature, cut.top_p, cut.top_k, seed=i) for i in range(n)]
            picked = _sample_rows(logits, rows, [new_generator(p, CPU) for p in rows])
            uniform = torch.cat([torch.rand(1, generator=new_generator(p, CPU)) for p in rows])
            scaled = logits / cut.temperature
            top_k = torch.full((n,), cut.top_k or vocab)
            top_p = torch.full((n,), cut.top_p)
            assert picked.tolist() == _draw_sorted(scaled, top_k, top_p, uniform).tolist(), cut
    # both paths: peaked rows are decided among their best ids, flat ones mostly are not
    top_k, top_p = torch.full((n,), vocab), torch.ones(n)
    uniform = torch.rand(n, generator=rng)
    assert bool(_draw_from_best(peaked / 0.8, CANDIDATES, top_k, top_p, uniform)[1].float().mean() > 0.9)
    assert not bool(_draw_from_best(flat, CANDIDATES, top_k, top_p, uniform)[1].all())
