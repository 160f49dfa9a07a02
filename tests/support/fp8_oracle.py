"""Pure-Python decoders of the fp8 formats, independent of torch's casts (the tests' oracle)."""

from __future__ import annotations

import math


def e4m3_value(byte: int) -> float:
    """float8_e4m3fn byte -> float64: bias 7, 3-bit mantissa, subnormals, 0x7f/0xff NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * math.ldexp(man, 1 - 7 - 3)  # 0.mmm * 2**(1-7); sign kept on zero
    return sign * math.ldexp(8 + man, exp - 7 - 3)  # 1.mmm * 2**(e-7)


def e8m0_value(byte: int) -> float:
    """e8m0 byte -> 2**(e - 127); e = 255 is NaN and e = 0 is 2**-127 (not zero)."""
    if byte == 255:
        return math.nan
    return math.ldexp(1.0, byte - 127)
