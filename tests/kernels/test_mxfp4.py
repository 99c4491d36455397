"""The MXFP4 reference decoding (`kernels.mxfp4`) against the format's definition, value by value."""

from __future__ import annotations

import pytest
import torch

from kernels.mxfp4 import E2M1_VALUES, check_mxfp4, dequantize_mxfp4, dequantize_packed, mxfp4_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_and_scale_decodes_to_its_value_times_its_power_of_two(dtype):
    """Every byte (both nibbles) under scales across e8m0's range, 0 (2 ** -127, a subnormal) and 254 included:
    the value times 2 ** (scale - 127), computed in float64 and rounded once to `dtype` (exact in bfloat16 and
    float32 within their range; float16 rounds what its range lacks, as that one rounding does)."""
    codes = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(3, 255, 16, 16).contiguous()
    scales = torch.arange(255, dtype=torch.uint8).view(1, 255, 1).expand(3, 255, 16).contiguous()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    values = torch.stack([table[(codes & 15).long()], table[(codes >> 4).long()]], dim=-1).flatten(-3)
    want = values * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)
    got = dequantize_mxfp4(codes, scales, dtype)
    assert got.shape == (3, 255, 512) and torch.equal(got, want.to(dtype))
    if dtype != torch.float16:   # nothing rounded, but past float32's range (6 x 2 ** 127: infinite, as the rounding)
        inside = want.abs() <= torch.finfo(torch.float32).max
        assert torch.equal(got.double()[inside], want[inside]) and got[~inside].isinf().all() and (~inside).any()
    assert torch.equal(dequantize_packed(codes.flatten(-2), scales, dtype), got)


def test_shapes_that_do_not_agree_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"got \(2, 4, 8\) torch.uint8 and \(2, 4\) torch.uint8"):
        check_mxfp4(torch.zeros(2, 4, 8, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.float32"):
        dequantize_mxfp4(torch.zeros(2, 4, 16), torch.zeros(2, 4, dtype=torch.uint8))


def test_the_scale_for_a_standard_deviation_gives_codes_drawn_alike_about_it():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (256, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    for std in (0.02, 0.1, 1.0):
        weights = dequantize_packed(packed, torch.full((256, 4), mxfp4_scale(std), dtype=torch.uint8), torch.float32)
        assert std / 1.5 < weights.std().item() < std * 1.5
