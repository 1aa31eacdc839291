"""Packed KV between engines that repeat the model's KV heads differently (kernels/kv_heads):
the first copy of every model head is kept and repeated as the target pool needs."""

from __future__ import annotations

import numpy as np
import pytest

from pdtopo.kernels.kv_heads import convert_heads


def _packed(base: int, r: int) -> np.ndarray:
    """[n=3, page=2, base*r, d=4]: model head k's value is k (+ position noise), r copies."""
    heads = np.repeat(np.arange(base), r)
    a = np.zeros((3, 2, base * r, 4), np.float32)
    a += heads[None, None, :, None] * 10 + np.arange(4)[None, None, None, :]
    return a


@pytest.mark.parametrize(("base", "r_from", "r_to"), [(2, 2, 1), (2, 1, 2), (1, 4, 2), (2, 2, 4),
                                                      (4, 1, 1)])
def test_heads_are_deduplicated_and_repeated(base, r_from, r_to):
    src, want = _packed(base, r_from), _packed(base, r_to)
    (out,) = convert_heads([src], base, base * r_to)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_a_pool_that_is_not_a_multiple_of_the_model_heads_is_refused():
    with pytest.raises(ValueError, match="model's 2 KV heads"):
        convert_heads([_packed(2, 2)], 2, 3)
