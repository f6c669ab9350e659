"""Numbers that define the formats (docs/formats.md). Nothing here imports more than the standard library."""

# MXFP4 element: E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit), no inf/nan.
F4_E2M1_MAX = 6.0
F4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
MX_BLOCK = 32  # elements per UE8M0 scale, along the last dim

# UE8M0 block scale: uint8 code c means 2**(c - 127); 255 is NaN (OCP MX v1.0).
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MAX_FINITE = 254
E8M0_ZERO_BLOCK = 0  # code written for an all-zero block: the smallest, so it never sets a group's max

# FP8 E4M3 (torch.float8_e4m3fn): max 448, no inf, NaN = S.1111.111.
F8_E4M3_MAX = 448.0
FP8_GROUP = 128  # 1x128 activation groups; 128x128 weight blocks
# FP8 power-of-two scales are FP32 with exponent clamped to the FP32 normal range.
FP8_SCALE_EXP_MIN = -126
FP8_SCALE_EXP_MAX = 127

# FP4 -> FP8 hierarchical alignment: group exponent = max(sub-block codes) - 6, because 6 * 2**6 = 384 <= 448.
FP4_TO_FP8_EXP_SHIFT = 6
# ... but never below code 1, so that the FP8 scale 2**(G-127) stays an FP32 normal.
FP4_TO_FP8_MIN_GROUP_CODE = 1

# Per-expert segments are padded to this many tokens in the column (transposed) FP8 layout, so that a
# 1x128 scale group along tokens never straddles two experts.
COL_SEGMENT_ALIGN = FP8_GROUP

SCALE_RULES = ("ceil", "floor")
