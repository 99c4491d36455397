"""How a replica's pool is shared among the gateways that lease it (`engine.sessions`): `lease_shares`,
max-min fair over their demands with an idle gateway's floor, their batch lines on top of what the
interactive demands leave, and the longest-waiting large request first; the sessions' demands as counted
and what they reserve and hold. Pure arithmetic on whole units."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["counted_demand", "held_credits", "lease_shares", "reserved_credits"]


def counted_demand(session, key: tuple[str, bool], demand: int, step: int) -> int:
    """A demand of `session`'s (an `engine.sessions.Session`) as the shares count it (`key`: a pool, and whether
    its batch lines'): rounded up to `step`, and kept until it moves more than a step away (a queue that
    hovers at a step's edge does not move the leases with every report) or to nothing."""
    counted = session.counted.get(key)
    if counted is None or abs(demand - counted) > step or not demand:
        counted = session.counted[key] = -(-demand // step) * step
    return counted


def reserved_credits(sessions: Sequence, pool: str) -> int:   # what their running requests reserve
    return sum(s.reserved.get(pool, 0) for s in sessions)


def held_credits(sessions: Sequence, pool: str) -> int:   # each its lease, or its reservations over it
    return sum(s.held(pool) for s in sessions)


def lease_shares(capacity: int, demands: Sequence[int], first: tuple[int, int] | None = None,
                 batch: Sequence[int] | None = None) -> list[int]:
    """Shares of `capacity` (whole units) among sessions demanding `demands`: max-min fair over the demands,
    each raised to at least half an equal share (capacity / 2k: room for an idle gateway's next requests);
    then what is left, max-min fair over `batch` (what their queued batch lines ask: they take only what
    the other demands leave, as within one gateway); then the rest spread so the smallest shares rise to
    one level. The shares add up to `capacity`. `first`: (index, units), a session given that much before
    the others share the rest."""
    k = len(demands)
    if not k:
        return []
    floor = capacity // (2 * k)
    wants = [max(floor, min(d, capacity)) for d in demands]
    batch = [min(b, capacity) for b in batch] if batch is not None else [0] * k
    if first is None or k == 1:
        return _fair(capacity, wants, batch)
    j, need = first
    need = min(max(need, 0), capacity)
    rest = [i for i in range(k) if i != j]
    shares = dict(zip(rest, _fair(capacity - need, [wants[i] for i in rest], [batch[i] for i in rest])))
    shares[j] = need
    return [shares[i] for i in range(k)]


def _fill(budget: int, wants: Sequence[int]) -> tuple[list[int], int]:
    """Water-filling: the smallest demands are met first, each at most an equal part of what is left.
    Returns (the shares, what is left)."""
    k = len(wants)
    shares, left = [0] * k, budget
    for n, i in enumerate(sorted(range(k), key=wants.__getitem__)):
        shares[i] = min(wants[i], left // (k - n))
        left -= shares[i]
    return shares, left


def _fair(budget: int, wants: Sequence[int], batch: Sequence[int]) -> list[int]:
    """`wants` water-filled, then `batch` on top from what is left, then what is still left raises the
    smallest shares to one level (the remainder to the lowest indices)."""
    k = len(wants)
    shares, left = _fill(budget, wants)
    more, left = _fill(left, batch)
    shares = [a + b for a, b in zip(shares, more)]
    order = sorted(range(k), key=shares.__getitem__)
    total, m = left, 0
    for m in range(1, k + 1):
        total += shares[order[m - 1]]
        if m == k or total // m <= shares[order[m]]:
            break
    level, extra = divmod(total, m)
    for n, i in enumerate(sorted(order[:m])):
        shares[i] = level + (n < extra)
    return shares
