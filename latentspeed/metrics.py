"""Accuracy arithmetic of ``latentspeed eval``: perplexity, and agreement between two runs.

Inputs are per-position records of one engine run over the same token windows:
``logprob`` of the actual next token, and ``top`` -- the engine's top-k log-probs as
``{token_id: logprob}`` -- where the engine reported them.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    token: int
    logprob: float
    top: dict[int, float]


def perplexity(positions: list[Position]) -> float:
    """``exp(-mean log p(actual token))``; ``ValueError`` for an empty run."""
    if not positions:
        raise ValueError("no scored positions: the text is shorter than two tokens")
    return math.exp(-sum(p.logprob for p in positions) / len(positions))


def _kl_on_reference_top(ref: Position, test: Position) -> float | None:
    """KL(ref || test) over the reference's top-k tokens, both renormalized on that set; None
    when the test run did not report one of those tokens."""
    if not ref.top or any(t not in test.top for t in ref.top):
        return None
    ref_z = math.log(sum(math.exp(v) for v in ref.top.values()))
    test_z = math.log(sum(math.exp(test.top[t]) for t in ref.top))
    return sum(math.exp(v - ref_z) * ((v - ref_z) - (test.top[t] - test_z)) for t, v in ref.top.items())


def agreement(reference: list[Position], test: list[Position]) -> dict:
    """How ``test`` differs from ``reference`` on the same positions.

    Returns mean / max |Δ log-prob| of the actual tokens, top-1 agreement (share of positions
    whose most likely token is the same, over positions where both runs reported a top-k), and
    the mean top-k KL (see ``_kl_on_reference_top``) with the number of positions it covers.
    """
    if len(reference) != len(test):
        raise ValueError(f"runs cover different positions: {len(reference)} and {len(test)}")
    if any(r.token != t.token for r, t in zip(reference, test)):
        raise ValueError("runs scored different tokens")
    if not reference:
        raise ValueError("no scored positions to compare")
    deltas = [abs(r.logprob - t.logprob) for r, t in zip(reference, test)]
    both_top = [(r, t) for r, t in zip(reference, test) if r.top and t.top]
    top1 = [max(r.top, key=r.top.get) == max(t.top, key=t.top.get) for r, t in both_top]
    kls = [kl for kl in (_kl_on_reference_top(r, t) for r, t in both_top) if kl is not None]
    return {
        "positions": len(deltas),
        "mean_abs_dlogprob": sum(deltas) / len(deltas),
        "max_abs_dlogprob": max(deltas),
        "top1_agreement": sum(top1) / len(top1) if top1 else None,
        "kl_topk": sum(kls) / len(kls) if kls else None,
        "kl_positions": len(kls),
    }
