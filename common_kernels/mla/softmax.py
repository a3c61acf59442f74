"""Streaming (online) softmax in base 2, shared by the decode and prefill kernels.

Scores arrive already multiplied by ``softmax_scale * log2(e)`` so ``exp2`` replaces ``exp``;
masked positions hold ``-inf``. A row that has seen no key yet keeps ``m = -inf`` and is
shifted by 0 instead, so no ``inf - inf`` NaN appears (FlashAttention-2's recurrence).
"""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """Fold one ``[R, N]`` tile of scores into the running max ``m_i [R]`` and sum ``l_i [R]``.

    Returns ``(p, alpha, m_new, l_new)``: the tile's unnormalized weights, the factor that
    rescales the accumulator built so far, and the updated max and sum.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finish_softmax(m_i, l_i):
    """``(1 / l, lse)`` per row: the normalizer (1 where no key was seen, whose accumulator is
    zero) and the natural-log log-sum-exp (``-inf`` where no key was seen)."""
    has_keys = l_i > 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))  # ln 2
    return 1.0 / safe_l, lse
