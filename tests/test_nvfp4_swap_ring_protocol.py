"""An exhaustive model of the mbarrier protocol of swap_gemm's PINGPONG ring, with and without PRODUCER.

kernels/nvfp4/swap_gemm.py, PINGPONG: two wgmma warp groups (partitions "h0", "h1") read ring slot
i % STAGES for step i: each waits on `ready[slot]` (count 1: one arrive.expect_tx, then the TMA bytes)
with parity (i // STAGES) & 1, reads its half of the packed weight and scales (the decode of step i,
during step i - 1), multiplies with the input tile (wgmma of step i, asynchronous until its wait), and
releases the slot by arriving on `empty[slot]` (count 2) at the end of step i. The last step decodes
itself once more (`_decode_slot(min(i + 1, n_k - 1))`).

Who refills:
* without PRODUCER (the protocol that ran on the H100, 2026-12-07): h0 fills steps 0 .. STAGES - 1
  before its loop and, at the end of step i > 0 (after its own arrive), waits on `empty` of step
  i - 1 (parity ((i - 1) // STAGES) & 1) and fills step i - 1 + STAGES;
* with PRODUCER: a third partition fills every step t in order, each after waiting on `empty` of
  slot t % STAGES with parity ((t // STAGES) & 1) ^ 1 (a fresh barrier passes parity 1 at once).

The kernel is not persistent: a CTA runs one (tile, split) and its barriers are initialized per CTA,
so split-K only changes n_k (the last split may have fewer steps) and the epilogue (no ring access);
the model covers n_k = 1 .. 7 per CTA.

Semantics modelled: an mbarrier has a count, pending arrivals, a pending transaction count and a
number of completed phases c; a phase completes when pending arrivals and transactions are both 0;
`try_wait.parity(p)` passes iff (c & 1) != p (so a wait two phases late blocks, one early passes: both
show as errors below). TMA bytes of a fill land at any later time (one asynchronous actor per slot in
flight). Every interleaving of the partitions and the landings is explored (memoized DFS). Checked:
no deadlock (some partition blocked forever with nothing left to run), a read only of the step it
expects with all its bytes landed, no fill into a slot while a partition still holds it (from its
first read of that step to its arrive on `empty`) or while an earlier fill is in flight, and every
fill and step done at the end. A partition's reads are "held" conservatively from the decode to the
arrive, which covers the asynchronous wgmma's read of the input tile.
"""
from __future__ import annotations

import pytest


def consumer_ops(half: int, n_k: int, stages: int, producer: bool) -> list[tuple]:
    """The ring operations of one wgmma partition, in program order (`_pingpong_half`, `_tma_steps`,
    `_swap_step_tma`, `_decode_slot`)."""
    ops: list[tuple] = []
    if not producer and half == 0:
        ops += [("fill", j) for j in range(min(stages, n_k))]
    ops += [("wait_ready", 0), ("read", 0)]  # step 0 decoded before the loop
    for i in range(n_k):
        nxt = min(i + 1, n_k - 1)
        ops += [("read", i),  # the wgmma of step i reads the input tile of its slot (async)
                ("wait_ready", nxt), ("read", nxt),  # decode of the next step (the last: itself again)
                ("arrive_empty", i)]  # after the wgmma wait and the partition's barrier
        if not producer and half == 0 and i > 0 and i - 1 + stages < n_k:
            ops += [("wait_empty", i - 1, ((i - 1) // stages) & 1), ("fill", i - 1 + stages)]
    return ops


def producer_ops(n_k: int, stages: int, mutant: str = "") -> list[tuple]:
    """`_pingpong_producer`: for each step, wait until its slot is free, then fill it. `mutant`: a
    broken variant for the model's own test ("no_wait": no wait; "parity": the parity not flipped)."""
    ops: list[tuple] = []
    for t in range(n_k):
        if mutant != "no_wait":
            ops.append(("wait_empty", t - stages, ((t // stages) & 1) ^ (0 if mutant == "parity" else 1)))
        ops.append(("fill", t))
    return ops


class ProtocolError(AssertionError):
    pass


def explore(n_k: int, stages: int, producer: bool, mutant: str = "", released_check: bool = True,
            limit: int = 5_000_000) -> dict:
    """Every interleaving of the partitions and the TMA landings; raises ProtocolError on a violation,
    returns {"states": ..., "max_ahead": ...} (max_ahead: the most steps filled beyond the last step
    both partitions released, over all reachable states). `mutant` breaks the producer on purpose
    (`producer_ops`; "count1": `empty` of count 1). `released_check`: also require that a fill of step
    t comes after both partitions released step t - STAGES (off: only the hazards themselves, a
    read of the wrong or unlanded bytes and a fill into a held slot, are checked)."""
    programs = [consumer_ops(0, n_k, stages, producer), consumer_ops(1, n_k, stages, producer)]
    if producer:
        programs.append(producer_ops(n_k, stages, mutant))
    e_count = 1 if mutant == "count1" else 2
    n_act = len(programs)
    # state: (pcs, ready, empty, data, inflight, holders, fills, arrived)
    #   ready / empty: per slot (pending arrivals, pending tx, completed phases)
    #   data: per slot, the step whose bytes landed there (-1 none); inflight: per slot, the step in flight or -1
    #   holders: per slot, frozenset of (partition, step) that read the slot and have not released it
    #   fills: steps filled so far; arrived: per partition, steps released so far
    init = (tuple([0] * n_act), tuple((1, 0, 0) for _ in range(stages)), tuple((e_count, 0, 0) for _ in range(stages)),
            tuple([-1] * stages), tuple([-1] * stages), tuple(frozenset() for _ in range(stages)), 0, (0, 0))
    seen = set()
    stats = {"states": 0, "max_ahead": 0}

    def complete(bar, count):
        pend, tx, c = bar
        return (count, 0, c + 1) if pend == 0 and tx == 0 else bar

    def succ(state):
        pcs, ready, empty, data, inflight, holders, fills, arrived = state
        out = []
        for a in range(n_act):
            if pcs[a] >= len(programs[a]):
                continue
            op = programs[a][pcs[a]]
            kind = op[0]
            npcs = pcs[:a] + (pcs[a] + 1,) + pcs[a + 1:]
            where = f"n_k={n_k} STAGES={stages} producer={producer} actor={a} op={op}"
            if kind == "wait_ready":
                j = op[1]
                if (ready[j % stages][2] & 1) != ((j // stages) & 1):
                    out.append((npcs, ready, empty, data, inflight, holders, fills, arrived))
            elif kind == "wait_empty":
                s = op[1] % stages
                if (empty[s][2] & 1) != op[2]:
                    out.append((npcs, ready, empty, data, inflight, holders, fills, arrived))
            elif kind == "read":
                j = op[1]
                s = j % stages
                if inflight[s] != -1 or data[s] != j:
                    raise ProtocolError(f"read of step {j} finds slot {s} with step {data[s]} "
                                        f"(in flight: {inflight[s]}): {where}")
                nh = holders[:s] + (holders[s] | {(a, j)},) + holders[s + 1:]
                out.append((npcs, ready, empty, data, inflight, nh, fills, arrived))
            elif kind == "arrive_empty":
                j = op[1]
                s = j % stages
                if (a, j) not in holders[s]:
                    raise ProtocolError(f"release of step {j} that was never read: {where}")
                nh = holders[:s] + (holders[s] - {(a, j)},) + holders[s + 1:]
                pend, tx, c = empty[s]
                ne = empty[:s] + (complete((pend - 1, tx, c), e_count),) + empty[s + 1:]
                narr = arrived[:a] + (arrived[a] + 1,) + arrived[a + 1:]
                out.append((npcs, ready, ne, data, inflight, nh, fills, narr))
            elif kind == "fill":
                t = op[1]
                s = t % stages
                if t != fills:
                    raise ProtocolError(f"fill of step {t} out of order (next {fills}): {where}")
                if holders[s]:
                    raise ProtocolError(f"fill of step {t} into slot {s} while {sorted(holders[s])} read it: {where}")
                if inflight[s] != -1:
                    raise ProtocolError(f"fill of step {t} into slot {s} while step {inflight[s]} is in flight: {where}")
                if released_check and t >= stages and min(arrived) <= t - stages:
                    raise ProtocolError(f"fill of step {t} before both released step {t - stages}: {where}")
                pend, tx, c = ready[s]
                if pend != 1 or tx != 0:
                    raise ProtocolError(f"arrive.expect_tx on slot {s} in an odd phase {ready[s]}: {where}")
                nr = ready[:s] + ((0, 1, c),) + ready[s + 1:]  # the one arrival done, the bytes pending
                ni = inflight[:s] + (t,) + inflight[s + 1:]
                out.append((npcs, nr, empty, data, ni, holders, fills + 1, arrived))
        for s in range(stages):  # the TMA engine: a slot's bytes land
            if inflight[s] != -1:
                pend, tx, c = ready[s]
                nr = ready[:s] + (complete((pend, tx - 1, c), 1),) + ready[s + 1:]
                nd = data[:s] + (inflight[s],) + data[s + 1:]
                ni = inflight[:s] + (-1,) + inflight[s + 1:]
                out.append((pcs, nr, empty, nd, ni, holders, fills, arrived))
        return out

    stack = [init]
    seen.add(init)
    while stack:
        state = stack.pop()
        stats["states"] += 1
        if stats["states"] > limit:
            raise RuntimeError(f"more than {limit} states")
        stats["max_ahead"] = max(stats["max_ahead"], state[6] - min(state[7]))
        nxt = succ(state)
        if not nxt:
            pcs, _, _, _, inflight, _, fills, _ = state
            done = all(pcs[a] == len(programs[a]) for a in range(n_act)) and all(f == -1 for f in inflight)
            if not done:
                blocked = [programs[a][pcs[a]] if pcs[a] < len(programs[a]) else "done" for a in range(n_act)]
                raise ProtocolError(f"deadlock: n_k={n_k} STAGES={stages} producer={producer}, "
                                    f"partitions at {blocked}")
            if fills != n_k:
                raise ProtocolError(f"ended with {fills} of {n_k} steps filled")
        for s in nxt:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return stats


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6])
def test_producer_ring_protocol_has_no_deadlock_or_race(stages):
    """PRODUCER: no deadlock, no early or stale read, no slot refilled while held, for 1-7 steps per
    CTA (split-K's shorter last split included); and the ring can be full (STAGES steps filled beyond
    the last step both halves released). STAGES 2 too (linear_swap still asks PINGPONG for 3)."""
    for n_k in range(1, 8):
        stats = explore(n_k, stages, producer=True)
        assert stats["max_ahead"] == min(stages, n_k), (n_k, stats)


@pytest.mark.parametrize("stages", [3, 4, 5, 6])
def test_pingpong_ring_protocol_without_producer_holds_from_three_stages(stages):
    """The protocol that ran (half 0 refills a step late) passes the same checks for STAGES >= 3."""
    for n_k in range(1, 8):
        explore(n_k, stages, producer=False)


def test_the_model_finds_the_known_pingpong_hang_at_two_stages():
    """The review of 2026-12-07 found that PINGPONG without a producer hangs with STAGES 2 (both halves
    wait for step i + 1 before half 0 issues it at the end of step i): the model must see it too."""
    with pytest.raises(ProtocolError, match="deadlock"):
        explore(3, 2, producer=False)


@pytest.mark.parametrize("mutant", ["no_wait", "parity", "count1"])
def test_the_model_catches_broken_producers(mutant):
    """The model's power: a producer that does not wait for a free slot, one that waits with the parity
    not flipped (it hangs on the fresh barrier), and `empty` with count 1 (one half's arrive frees the
    slot) each fail, found by the hazard checks alone (without the "both released" invariant): the
    first interleaving the search meets may be a hang (a slot refilled before it was read completes
    `ready` twice, and the late reader's parity wait never passes) or a read of the wrong bytes."""
    with pytest.raises(ProtocolError):
        for n_k in range(1, 8):
            explore(n_k, 3, producer=True, mutant=mutant, released_check=False)
