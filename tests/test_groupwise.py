"""codecs/groupwise: KIVI-style asymmetric group quantization, error bound and exact byte size."""

from __future__ import annotations

import pytest
import torch

from kvshrink.codecs.groupwise import dequantize_groups, group_code_bytes, quantize_groups


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_is_at_most_half_a_step(bits):
    torch.manual_seed(bits)
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 20, 64) + 3.0  # groups with different ranges
    code = quantize_groups(x, bits, 32)
    y = dequantize_groups(code)
    step = code.scale.float().repeat_interleave(32, dim=-1)
    zero = code.zero.float().abs().repeat_interleave(32, dim=-1)
    bound = step / 2 + zero * 2.0**-11 + 1e-6  # half a step, plus the fp16 rounding of the zero point
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= bound).all())
    # the codes span the range: the step is (max - min) / (2^bits - 1) up to fp16 rounding
    g = x.reshape(3, 5, 2, 32)
    expected = (g.amax(-1) - g.amin(-1)) / (2**bits - 1)
    torch.testing.assert_close(code.scale.float(), expected, rtol=2e-3, atol=1e-4)


def test_bytes_by_hand():
    x = torch.randn(2, 3, 40, 64)
    code = quantize_groups(x, 2, 32)
    # 2*3*40 rows x 2 groups; each group: 32 codes x 2 bits = 8 bytes + fp16 step + fp16 zero
    assert code.nbytes() == 2 * 3 * 40 * 2 * (8 + 4) == group_code_bytes(x.numel(), 2, 32)
    assert code.codes.dtype == torch.uint8


def test_constant_group_is_exact_and_inputs_untouched():
    x = torch.full((4, 32), 1.5)
    before = x.clone()
    y = dequantize_groups(quantize_groups(x, 4, 32))
    assert torch.equal(x, before)
    torch.testing.assert_close(y, x)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_groups(torch.randn(4, 30), 2, 32)
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(torch.randn(4, 32), 0, 32)
    with pytest.raises(ValueError, match="floating-point"):
        quantize_groups(torch.ones(4, 32, dtype=torch.long), 2, 32)
