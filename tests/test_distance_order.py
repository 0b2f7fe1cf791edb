"""The reported distances do not depend on the order of the tensor names (a set's order follows Python's hash
seed, so an order-dependent float sum made `--json` distances differ in the last bit from run to run)."""

from __future__ import annotations

import torch

from symalign.match.distance import relative_distance


def test_relative_distance_is_the_same_float_in_any_name_order() -> None:
    g = torch.Generator().manual_seed(0)
    names = [f"layer.{i}.w{j}" for i in range(30) for j in range(3)]
    a = {n: torch.randn(7, generator=g, dtype=torch.float64) * 10.0 ** (i % 7) for i, n in enumerate(names)}
    b = {n: torch.randn(7, generator=g, dtype=torch.float64) for n in names}
    forward = relative_distance(a, b, names)
    assert relative_distance(a, b, names[::-1]) == forward
    assert relative_distance(a, b, names[1::2] + names[::2]) == forward
