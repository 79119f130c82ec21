"""bench/int8_products.py's two int8 products: each row quantized on its own scale gives the same
bits alone as among other rows (what made one of them a candidate for a serving engine), and
both stay close to the float32 product."""

import pytest
import torch

from bench.int8_products import FbgemmRows, IntMmRows

# torch 2.13 warns that the quantized tensors fbgemm's product takes are deprecated: known, and
# one of the reasons the product was not adopted (docs/decisions.md, decision 88)
pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning")


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    rows = torch.randn(24, 64) * torch.linspace(0.01, 50, 24)[:, None]  # ranges three decades apart
    for product in (FbgemmRows(w), IntMmRows(w)):
        together = product(rows)
        for i in (0, 11, 23):
            assert torch.equal(product(rows[i : i + 1]), together[i : i + 1]), type(product).__name__


def test_one_scale_for_the_tensor_would_depend_on_them() -> None:
    """The check above can fail: fbgemm's own dynamic product, one scale for the whole input."""
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    rows = torch.randn(24, 64) * torch.linspace(0.01, 50, 24)[:, None]
    packed = FbgemmRows(w).packed
    alone = torch.ops.quantized.linear_dynamic(rows[:1], packed, True)
    assert not torch.equal(alone, torch.ops.quantized.linear_dynamic(rows, packed, True)[:1])


def test_both_are_close_to_the_float_product() -> None:
    torch.manual_seed(1)
    w = torch.randn(128, 96) * 0.05
    rows = torch.randn(20, 96)
    exact = rows @ w.T
    for product in (FbgemmRows(w), IntMmRows(w)):
        error = (product(rows) - exact).norm() / exact.norm()
        assert error < 0.03, (type(product).__name__, float(error))
