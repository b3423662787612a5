"""tolerances.unit_roundoff and compute_roundoff are cached: a cache keyed by value alone
would answer np.float16's u for np.float32 once either had been asked (the two scalars
compare and hash equal), and NumPy takes either for its type."""

import numpy as np
from normspec.conformance import tolerances


def test_equal_values_of_two_types_are_two_keys():
    assert (tolerances.unit_roundoff(np.float32(1.0)), tolerances.unit_roundoff(np.float16(1.0))) \
        == (2.0 ** -24, 2.0 ** -11)
    assert (tolerances.compute_roundoff(np.float64(1.0)), tolerances.compute_roundoff(np.float16(1.0))) \
        == (2.0 ** -53, 2.0 ** -24)
