"""Small statistics the step model needs."""

from __future__ import annotations

import math


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.564 for 2; 1.424 for 8), by quadrature:
    the expected lead of the slowest of n ranks whose step times vary independently."""
    if n <= 1:
        return 0.0
    h, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * h
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * h
    return total
