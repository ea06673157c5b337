"""The reconnect delay: one pure function for the workflow's durable timers and for clients."""

from __future__ import annotations


def reconnect_delay(attempt: int, base_s: float, max_s: float, u: float) -> float:
    """`min(base·2^attempt, max)·U(0.5, 1)`, with `u` drawn uniformly from [0, 1).

    The workflow draws `u` from `workflow.random()` (deterministic on replay); clients from
    `random.random()`. The jitter keeps many clients that lost the same server from coming back
    in lockstep; the lower bound of half the delay keeps the backoff meaningful.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if not 0.0 <= u < 1.0:
        raise ValueError("u must be in [0, 1)")
    exponent = min(attempt, 62)  # 2**62 s is already far past any max_s
    return min(base_s * 2.0**exponent, max_s) * (0.5 + 0.5 * u)
