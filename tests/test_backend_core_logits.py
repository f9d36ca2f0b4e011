"""The logits matmul on the CPU (:class:`gpu_backend.model.OneDnnLinear`): oneDNN over a packed
copy of the weight gives ``F.linear``'s values, and a weight changed after the first call (in
place, or a new tensor) is packed again, never read stale."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gpu_backend.model import OneDnnLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def _linear(out_features: int = 1000, in_features: int = 64) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=False)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_values_are_f_linear_s(rows: int) -> None:
    m, f = _linear(), OneDnnLinear()
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        got = f(m, x)
        assert got.shape == (rows, 1000) and got.dtype == torch.float32 and not got.is_mkldnn
        assert torch.allclose(got, F.linear(x, m.weight), atol=1e-5, rtol=1e-5)
        assert f._packed is not None and f._packed.is_mkldnn


def test_a_weight_written_in_place_or_replaced_is_packed_again() -> None:
    m, f = _linear(), OneDnnLinear()
    x = torch.randn(4, 64)
    with torch.inference_mode():
        before = f(m, x)
        with torch.no_grad():
            m.weight.mul_(-2.0)  # the same storage: only the version tells
        assert torch.allclose(f(m, x), -2.0 * before, atol=1e-4)
    m.weight = torch.nn.Parameter(torch.zeros(1000, 64))
    with torch.inference_mode():
        assert torch.equal(f(m, x), torch.zeros(4, 1000))
        m.weight = torch.nn.Parameter(torch.ones(1000, 64))  # an inference tensor: never packed
        assert torch.equal(f(m, x), F.linear(x, m.weight)) and f._key[0] != m.weight.data_ptr()


def test_a_copied_model_packs_its_own_weight() -> None:
    m, f = _linear(), OneDnnLinear()
    x = torch.randn(2, 64)
    with torch.inference_mode():
        f(m, x)
    g = copy.deepcopy(f)
    assert g._packed is None
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        m2.weight.zero_()
    with torch.inference_mode():
        assert torch.equal(g(m2, x), torch.zeros(2, 1000))
        assert not torch.equal(f(m, x), torch.zeros(2, 1000))


def test_no_rows_a_bias_or_another_dtype_take_f_linear() -> None:
    f = OneDnnLinear()
    with torch.inference_mode():
        assert f(_linear(), torch.randn(0, 64)).shape == (0, 1000)
        biased = torch.nn.Linear(64, 10)
        x = torch.randn(2, 64)
        assert torch.equal(f(biased, x), F.linear(x, biased.weight, biased.bias))
        half = _linear().to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        assert torch.equal(f(half, xb), F.linear(xb, half.weight))
    assert f._packed is None
