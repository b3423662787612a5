"""float16 / bfloat16 in the kernel: 16-bit patterns in, 16-bit patterns out, float32 in
between, rounded to nearest even, so a half-precision row is read and written once."""

import numpy as np

from ._numba_jit import inline


@inline
def decode(h, fmt):
    """uint16 bits (fmt 0: float16, 1: bfloat16) -> float32 bits. float16 finite values
    come out with the exponent still biased by 15: the caller multiplies by 2^112,
    which rebiases normals and subnormals alike, exactly."""
    h = np.uint32(h)
    if fmt == 1:
        return h << np.uint32(16)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):  # inf, nan
        return sign | np.uint32(0x7F800000) | mag
    return sign | mag

@inline
def encode(v, bits, fmt):
    """float32 value (and its bits) -> uint16 bits, rounded to nearest, ties to even
    (checked against NumPy's and ml_dtypes' casts on every float16 and 5M float32)."""
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    a = bits & np.uint32(0x7FFFFFFF)
    if fmt == 1:
        if a > np.uint32(0x7F800000):
            return np.uint16(sign | np.uint32(0x7FC0))
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                         >> np.uint32(16))
    if a >= np.uint32(0x47800000):  # |v| >= 65536: inf, or nan
        nan = a > np.uint32(0x7F800000)
        return np.uint16(sign | (np.uint32(0x7E00) if nan else np.uint32(0x7C00)))
    if a < np.uint32(0x38800000):  # a float16 subnormal: exact after scaling by 2^24
        return np.uint16(sign | np.uint32(np.rint(abs(v) * np.float32(16777216.0))))
    odd = (a >> np.uint32(13)) & np.uint32(1)
    a = a - np.uint32(0x38000000) + np.uint32(0xFFF) + odd  # rebias 127 -> 15, round
    return np.uint16(sign | (a >> np.uint32(13)))

@inline
def decode_row(src, dst_bits, dst, fmt):
    for j in range(src.shape[0]):
        dst_bits[j] = decode(src[j], fmt)
    if fmt == 0:
        for j in range(src.shape[0]):
            if (src[j] & np.uint16(0x7C00)) != np.uint16(0x7C00):
                dst[j] = dst[j] * np.float32(2.0**112)

@inline
def encode_row(src, src_bits, dst, fmt):
    for j in range(src.shape[0]):
        dst[j] = encode(src[j], src_bits[j], fmt)
