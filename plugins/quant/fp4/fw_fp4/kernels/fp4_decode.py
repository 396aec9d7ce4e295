"""FP4 decoding by bit manipulation inside Triton kernels (no lookup table; see ``fw_fp4.formats``)."""

import triton
import triton.language as tl


@triton.jit
def e2m1(codes):
    """e2m1 codes in the low 4 bits of int32s (higher bits are ignored) -> their values times 2^-14,
    float32 (the fp16 placement)."""
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def scale_factor(sbytes, E8M0: tl.constexpr):
    """Scale bytes (int32) -> the float32 factor that turns :func:`e2m1`'s values into ``e2m1 * scale``."""
    if E8M0:  # rebased by +14 at load: the code's 2^-14 is folded in
        factor = (sbytes << 23).to(tl.float32, bitcast=True)
    else:  # e4m3 as fp16 bits is the value times 2^-8; with the code's 2^-14, 2^22 restores it
        bits = ((sbytes & 0x80) << 8) | ((sbytes & 0x7F) << 7)
        factor = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0
    return factor
