"""fp32 matmuls on the CPU through a packed GEMM (:class:`gpu_backend.packed_linear.PackedMatmul`):
every row count in range gives ``F.linear``'s values with either library (MKL's, oneDNN's; the
weight is packed once, for a hint of 8 rows), the faster library is picked once per weight shape,
a weight changed after the first call (in place, or a new tensor) is packed again, never read
stale, and the model's layers and logits take the packed path."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from gpu_backend import packed_linear
from gpu_backend.model import LlamaModel, ModelConfig
from gpu_backend.packed_linear import LAYER_ROWS, LOGITS_ROWS, PACKERS, PackedMatmul, Packer

pytestmark = pytest.mark.skipif(not PACKERS, reason="no packed GEMM (MKL, oneDNN) in this torch build")


def _weight(out_features: int = 1000, in_features: int = 64) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=False).weight


@pytest.mark.parametrize("packer", PACKERS, ids=[p.name for p in PACKERS])
@pytest.mark.parametrize("rows", range(1, 17))
def test_every_row_count_in_range_gives_f_linear_s_values(rows: int, packer: Packer, monkeypatch) -> None:
    monkeypatch.setitem(packed_linear._FASTEST, (1000, 64), packer)
    w, f = _weight(), PackedMatmul(LOGITS_ROWS)
    b = torch.randn(1000)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        got, biased = f(x, w), f(x, w, b)
        assert got.shape == (rows, 1000) and got.dtype == torch.float32 and not got.is_mkldnn
        assert torch.allclose(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
        assert torch.allclose(biased, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        assert f._packed is not None and f._packed.is_mkldnn and f._packer is packer


def test_the_faster_library_is_picked_once_per_weight_shape(monkeypatch) -> None:
    """Two packers, one 5 ms slower a call: the quicker is picked for a shape after one warm-up
    and :data:`~gpu_backend.packed_linear.TIMED_CALLS` timed calls of each, and remembered: a second
    weight of that shape times nothing, a weight of another shape is timed afresh. The clock the
    module reads advances by each call's delay alone (with ``time.sleep`` and the real clock, three
    quick calls each preempted for over 5 ms on a loaded machine once picked the slow one)."""
    calls = {"slow": 0, "quick": 0}
    now = [0.0]

    def make(name: str, delay: float) -> Packer:
        def linear(x, packed, w, b, rows):
            calls[name] += 1
            now[0] += delay
            return F.linear(x, packed, b)

        return Packer(name, lambda w, rows: w.clone(), linear)

    slow, quick = make("slow", 0.005), make("quick", 0.0)
    monkeypatch.setattr(packed_linear, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(packed_linear, "PACKERS", (slow, quick))
    monkeypatch.setattr(packed_linear, "_FASTEST", {})
    w = _weight()
    assert packed_linear.fastest(w) is quick
    timed = 1 + packed_linear.TIMED_CALLS
    assert calls == {"slow": timed, "quick": timed}
    assert packed_linear.fastest(_weight().detach().clone()) is quick and calls == {"slow": timed, "quick": timed}
    assert packed_linear.fastest(_weight(10, 64)) is quick and calls == {"slow": 2 * timed, "quick": 2 * timed}
    f = PackedMatmul(LOGITS_ROWS)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.allclose(f(x, w), F.linear(x, w)) and f._packer is quick


def test_rows_outside_the_range_take_f_linear_and_pack_nothing() -> None:
    w, f = _weight(), PackedMatmul(LAYER_ROWS)
    with torch.inference_mode():
        for rows in (0, 1, 2, 17, 64):
            x = torch.randn(rows, 64)
            assert torch.equal(f(x, w), F.linear(x, w))
    assert f._packed is None


def test_a_weight_written_in_place_or_replaced_is_packed_again() -> None:
    w, f = _weight(), PackedMatmul(LOGITS_ROWS)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        before = f(x, w)
        with torch.no_grad():
            w.mul_(-2.0)  # the same storage: only the version tells
        assert torch.allclose(f(x, w), -2.0 * before, atol=1e-4)
    w = torch.zeros(1000, 64)
    with torch.inference_mode():
        assert torch.equal(f(x, w), torch.zeros(4, 1000))
        w = torch.ones(1000, 64)  # an inference tensor: never packed
        assert torch.equal(f(x, w), F.linear(x, w)) and f._key is not None and f._key[0] != w.data_ptr()


def test_a_copy_packs_its_own_weight() -> None:
    w, f = _weight(), PackedMatmul(LOGITS_ROWS)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        f(x, w)
    g = copy.deepcopy(f)
    assert g._packed is None and (g.min_rows, g.max_rows) == LOGITS_ROWS
    w2 = w.detach().clone().zero_()
    with torch.inference_mode():
        assert torch.equal(g(x, w2), torch.zeros(2, 1000))
        assert not torch.equal(f(x, w), torch.zeros(2, 1000))


def test_another_dtype_takes_f_linear() -> None:
    f = PackedMatmul(LOGITS_ROWS)
    w = _weight().to(torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(f(x, w), F.linear(x, w))
    assert f._packed is None and f.packed_bytes(w) == 0


def _tiny() -> LlamaModel:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    return LlamaModel(cfg).eval()


def test_the_model_packs_every_matmul_and_counts_the_copies() -> None:
    m = _tiny()
    # per layer: qkv 64 x (64 + 32 + 32), o 64 x 64, gate and up 64 x 128, down 128 x 64; logits 64 x 300
    per_layer = 64 * 128 + 64 * 64 + 3 * 64 * 128
    assert m.prepack() == 4 * (2 * per_layer + 64 * 300)
    assert all(f._matmul._packed is not None for f in m._linears()) and m._logits._packed is not None
    x = torch.randn(5, 64)
    with torch.inference_mode():
        a = m.model.layers[0].mlp
        want = F.linear(F.silu(F.linear(x, a.gate_proj.weight)) * F.linear(x, a.up_proj.weight), a.down_proj.weight)
        assert torch.allclose(a(x), want, atol=1e-5, rtol=1e-5)
        assert torch.allclose(m.compute_logits(x), F.linear(x, m.lm_head.weight), atol=1e-5, rtol=1e-5)
    # a state dict loaded in place is seen by the next call: no stale packed copy
    sd = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    m.load_state_dict(sd)
    with torch.inference_mode():
        assert torch.equal(m.model.layers[0].mlp(x), torch.zeros(5, 64))
        assert torch.equal(m.compute_logits(x), torch.zeros(5, 300))


def test_a_model_built_under_inference_mode_is_never_packed() -> None:
    """Its parameters have no version counter (reading it raises), so an in-place write could not
    be told from the packed copy: every matmul stays ``F.linear``, and the copies count 0."""
    with torch.inference_mode():
        m = _tiny()
        x = torch.randn(4, 64)
        assert m.prepack() == 0
        a = m.model.layers[0].self_attn
        assert torch.equal(a.o(x), F.linear(x, a.o_proj.weight))
        assert torch.equal(m.compute_logits(x), F.linear(x, m.lm_head.weight))
    assert all(f._matmul._packed is None for f in m._linears()) and m._logits._packed is None


def test_packing_switched_off_packs_nothing_and_counts_nothing() -> None:
    """``prepack(False)`` (the engine's ``packed_weights=False``, ``--no-packed-weights``): every
    matmul is ``F.linear`` itself and copies made before are dropped."""
    m = _tiny()
    assert m.prepack() > 0
    assert m.prepack(False) == 0
    assert all(f._matmul._packed is None for f in m._linears()) and m._logits._packed is None
    x = torch.randn(5, 64)
    with torch.inference_mode():
        a = m.model.layers[0].self_attn
        assert torch.equal(a.o(x), F.linear(x, a.o_proj.weight))
        assert torch.equal(m.compute_logits(x), F.linear(x, m.lm_head.weight))
    assert all(f._matmul._packed is None for f in m._linears()) and m._logits._packed is None


def test_the_flag_reaches_the_engine_config() -> None:
    from gpu_backend.cli import parse_args

    assert parse_args([]).packed_weights is True
    assert parse_args(["--no-packed-weights"]).packed_weights is False
