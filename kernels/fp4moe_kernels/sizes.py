"""Bytes of the formats (docs/formats.md) from shapes alone: the one place the byte formulas live, torch-free.

The ops' saved-bytes and all-to-all accounting (``fp4moe.ops``) and the paper-scale model (``fp4moe.scale``, which
runs without torch) both count with these. This module imports only ``constants``, and importing it does not import
torch: the package's ``__init__`` loads its torch modules on first use.

    mxfp4_bytes(m, k)          E2M1 codes (2 per byte) + one UE8M0 scale byte per 32 elements
    fp8_row_bytes(m, k)        E4M3 [m, k] + one FP32 scale per 1x128 group along k
    fp8_row_col_bytes(m, k, mp)  FP8 rows of [m, k] + FP8 columns of the transpose [k, mp] (mp: m padded to 128)
    payload_row_bytes(h, codec)  one all-to-all row of h channels: mxfp4, fp8 or bf16
"""
from __future__ import annotations

from .constants import FP8_GROUP, MX_BLOCK

FP8_SCALE_BYTES = 4  # one FP32 power-of-two scale per 1x128 group
BF16_BYTES = 2
CODECS = ("mxfp4", "fp8", "bf16")  # the all-to-all's row formats


def pad_to_group(n: int) -> int:
    """``n`` rounded up to a multiple of the 128-token FP8 group (a column segment's padded length)."""
    return -(-n // FP8_GROUP) * FP8_GROUP


def mxfp4_bytes(m: int, k: int) -> int:
    """MXFP4 ``[m, k]``: E2M1 codes (2 per byte) + one UE8M0 scale byte per 32 elements."""
    return m * k // 2 + m * k // MX_BLOCK


def fp8_row_bytes(m: int, k: int) -> int:
    """FP8 rows ``[m, k]``: E4M3 bytes + FP32 scales ``[m, k/128]``."""
    return m * k + FP8_SCALE_BYTES * m * k // FP8_GROUP


def fp8_row_col_bytes(m: int, k: int, mp: int | None = None) -> int:
    """FP8 rows (E4M3 [m,k] + FP32 scales [m,k/128]) + FP8 columns (E4M3 [k,mp] + FP32 scales [k,mp/128]); ``mp``:
    the tokens padded to 128 per segment (default: ``m`` padded, one segment)."""
    mp = pad_to_group(m) if mp is None else mp
    return fp8_row_bytes(m, k) + fp8_row_bytes(k, mp)


def payload_row_bytes(hidden: int, codec: str) -> int:
    """Bytes of one payload row of ``hidden`` channels: mxfp4 ``H/2 + H/32``, fp8 ``H + 4*(H/128)``, bf16 ``2*H``."""
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of {CODECS}")
    if codec == "mxfp4":
        return hidden // 2 + hidden // MX_BLOCK
    if codec == "fp8":
        return hidden + FP8_SCALE_BYTES * (hidden // FP8_GROUP)
    return BF16_BYTES * hidden


__all__ = ["BF16_BYTES", "CODECS", "FP8_SCALE_BYTES", "fp8_row_bytes", "fp8_row_col_bytes", "mxfp4_bytes",
           "pad_to_group", "payload_row_bytes"]
