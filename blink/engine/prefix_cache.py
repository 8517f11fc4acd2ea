"""Prefix caching over hash-chained full KV blocks, as fixed-shape tensor code.

A block is registered once all its ``block_size`` tokens have KV. Its key is a hash of the
whole prefix up to its end (so equal keys mean "same prefix", not just "same block"), kept as
two polynomial hashes modulo 31-bit primes: every product fits in int64, so the arithmetic is
exact on every device and the per-token terms can be summed with ``cumsum``.

The table is open addressing with a bounded probe window: slot ``key % H`` and the next
``prefix_probes - 1`` slots hold block ids. A slot is live only while the block it names
points back at it (``block_slot[b] == slot``), so evicting a block (reallocating it) or losing
a parallel insert needs no table write: stale entries just stop matching.

Tenants are isolated by ``cache_salt`` (a request field; 0 = unsalted): a block's key is
``table_key(prefix hash) ^ salt`` of the request that registered it, so two requests of the
same tokens but different salts look for different keys, block after block (vLLM puts the
salt into the first block's hash, and the chain carries it). Equal tokens give equal prefix
hashes, so their keys differ exactly when the salts do; different tokens are refused by the
verification below whatever the keys: a salted request never reuses another salt's blocks,
nor the unsalted ones, and unsalted requests never reuse salted blocks.

A hash match is never trusted. A hit on block j of a request needs: the stored key matches,
the stored tokens equal the request's tokens, and the block's recorded parent is exactly the
block hit at j - 1 with the generation it had when the child was registered (a block's
generation changes whenever it is reallocated, so a stale child never validates). By
induction the whole prefix is verified token by token, whatever the hash does (the tests force
every key to collide).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from blink.engine.sched.state import EngineState, SchedulerConfig

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: how many rounds the table insert runs: a block that lost its slot to an older request's
#: block of the same step chooses again among the slots left (a fixed count: a captured GPU
#: step has no loop that depends on data). Measured with 31-127 blocks a step filling a
#: quarter of the table: one round left half of such prompts partly uncached, three none.
INSERT_ROUNDS = 3

# Two Mersenne-ish primes and bases: key = (h1 << 31) | h2, a 62-bit prefix key.
PRIMES = (2_147_483_647, 2_147_483_629)
BASES = (1_000_003, 998_244_353)


class HashConstants(NamedTuple):
    """The hash's device constants, built once on the host at startup (a captured step may
    not build tensors from Python data)."""

    pows: torch.Tensor  # int64 [2, length]: BASES[m] ** i mod PRIMES[m]
    primes: torch.Tensor  # int64 [2, 1]: the moduli, shaped to broadcast over [2, ...]


def hash_constants(length: int, device: torch.device | str) -> HashConstants:
    """The powers for ``length`` token positions and the moduli, on ``device``."""
    rows = []
    for base, prime in zip(BASES, PRIMES):
        acc, row = 1, []
        for _ in range(length):
            row.append(acc)
            acc = acc * base % prime
        rows.append(row)
    return HashConstants(
        pows=torch.tensor(rows, dtype=torch.int64, device=device),
        primes=torch.tensor(PRIMES, dtype=torch.int64, device=device).view(2, 1),
    )


def table_key(h: torch.Tensor) -> torch.Tensor:
    """The table key of prefix hashes ``h`` [2, ...] (each < 2**31): int64 [...] >= 0.

    Module-level on purpose: the tests replace it with a constant to force collisions."""
    return (h[0] << 31) | h[1]


def salted(key: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """A table key under a request's ``cache_salt`` (int64 >= 0; 0 leaves the key as is):
    both are below 2**63, so the result is too."""
    return key ^ salt


def token_terms(ids: torch.Tensor, positions: torch.Tensor, hc: HashConstants) -> torch.Tensor:
    """Per-token hash terms [2, *ids.shape]: (id + 1) * base**pos mod p. The prefix hash of
    a sequence is the sum of its tokens' terms mod p. ``positions`` matches the trailing
    dimensions of ``ids``."""
    p = hc.primes.view(2, *([1] * ids.dim()))
    pw = hc.pows[:, positions]
    pw = pw.view(2, *([1] * (ids.dim() - positions.dim())), *positions.shape)
    return (ids.long().unsqueeze(0) + 1) * pw % p


def lookup(
    st: EngineState,
    cfg: SchedulerConfig,
    rows: torch.Tensor,
    ok: torch.Tensor,
    eligible: torch.Tensor,
    lanes: torch.Tensor,
    hc: HashConstants,
    stamp: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Find and take the longest verified cached prefix of each row in ``rows`` [K] (where
    ``ok``), among its first ``eligible`` [K] full blocks (the caller caps them so at least
    the row's last token is still computed: its logits are needed, and so that they fit the
    window). Writes the hit blocks into the block table and takes a reference on each.

    The work is one flat window: ``lanes`` [W] = ``arange(W)``, lane w is block j of row k
    in row order, ``sum(eligible) <= W``. ``stamp(j)``: the LRU stamp of block index j.

    Returns (hit blocks per row [K], prefix hash at the end of the hit [K, 2], number of
    hash matches rejected by verification).
    """
    N, B, M, H = cfg.num_blocks, cfg.block_size, cfg.max_blocks_per_seq, cfg.hash_table_size
    K = rows.shape[0]
    dev = rows.device
    p = hc.primes  # [2, 1]
    take = torch.where(ok, eligible, 0)
    ends = take.cumsum(0)
    starts = ends - take
    k = torch.searchsorted(ends, lanes, right=True).clamp(max=K - 1)  # [W]
    j = lanes - starts[k]  # block index within its row
    valid = lanes < ends[-1]
    row = rows[k]
    cols = (j * B).unsqueeze(1) + torch.arange(B, device=dev)  # [W, B] token columns
    toks = st.tokens[row.unsqueeze(1), cols.clamp(max=M * B - 1)]  # [W, B]
    terms = token_terms(toks, cols.clamp(max=M * B - 1), hc).sum(-1) % p  # [2, W]
    terms = terms * valid
    # Prefix hash at the end of each block: a cumulative sum restarted at each row (the
    # rows looked up hold no computed tokens, so their hash starts at 0).
    incl = terms.cumsum(1)
    before = (incl - terms).gather(1, starts[k].unsqueeze(0).expand(2, -1))
    h = (incl - before) % p  # [2, W]
    key = salted(table_key(h), st.sampling["cache_salt"][row])  # [W]

    probe = (key % H).unsqueeze(-1) + torch.arange(cfg.prefix_probes, device=dev)
    probe = probe % H  # [W, P]
    cand = st.hash_table[probe]
    live = (st.block_slot[cand] == probe) & (st.block_key[cand] == key.unsqueeze(-1))
    first = live.int().argmax(-1, keepdim=True)  # first live match in the window
    blk = torch.where(live.any(-1) & valid, cand.gather(-1, first).squeeze(-1), N)  # [W]

    # Verification: tokens equal, and the chain of parents is exactly the blocks hit so far.
    same_tokens = (st.block_tokens[blk] == toks).all(-1)
    previous = torch.cat([torch.full((1,), N, dtype=blk.dtype, device=dev), blk[:-1]])
    parent = torch.where(j > 0, previous, N)
    same_parent = (st.block_parent[blk] == parent) & (
        (parent == N) | (st.block_parent_gen[blk] == st.block_gen[parent])
    )
    found = blk < N
    verified = found & same_tokens & same_parent
    # Leading verified blocks per row: the first lane of the row that is not verified.
    miss = valid & ~verified
    n_hit = take.clone()
    n_hit.scatter_reduce_(0, torch.where(miss, k, K - 1), torch.where(miss, j, take[K - 1]), "amin")
    at_hit_end = valid & (j == n_hit[k])
    rejects = (found & ~verified & at_hit_end).sum()  # at the first miss

    hit = valid & (j < n_hit[k])
    hit_blk = torch.where(hit, blk, N)
    table = st.block_table_flat
    at = torch.where(hit, row * M + j, table.shape[0] - 1)  # misses to the table's sink
    table.index_put_((at,), hit_blk.to(table.dtype))
    st.block_ref.index_add_(0, hit_blk, hit.to(st.block_ref.dtype))
    st.block_last_used.scatter_reduce_(0, hit_blk, torch.where(hit, stamp(j), 0), "amax")

    last = (starts + n_hit - 1).clamp(min=0)  # lane of each row's last hit block
    hit_hash = torch.where(n_hit.unsqueeze(1) > 0, h[:, last].T, 0)  # [K, 2]
    return n_hit, hit_hash, rejects


def register(
    st: EngineState,
    cfg: SchedulerConfig,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    valid: torch.Tensor,
    hc: HashConstants,
    stamp: torch.Tensor,
    when: Callable[[torch.Tensor], bool] = lambda needed: True,
) -> None:
    """After a step's forward: record the tokens computed into each block, advance the rows'
    prefix hashes, and insert every block this step filled into the table.

    All inputs are the step's flat token arrays (a prefix of [T] covering the step's tokens
    is enough); ``valid`` masks the padding. ``when``: the scheduler's stage guard, asked
    whether any block was filled before the table insert runs."""
    N, B, H = cfg.num_blocks, cfg.block_size, cfg.hash_table_size
    p = hc.primes

    # Token ids go where their KV went (padding lands in the scratch block).
    st.block_tokens.view(-1).index_copy_(0, slot_mapping, input_ids.to(st.block_tokens.dtype))

    # Prefix hash at every token: the row's hash before the step + this step's terms so far.
    terms = token_terms(input_ids, positions, hc) * valid  # [2, T]
    incl = terms.cumsum(1)
    start = query_start_loc.long()[rows]
    before_row = (incl - terms).gather(1, start.unsqueeze(0).expand(2, -1))
    prefix = (st.row_hash[rows].T + incl - before_row) % p  # [2, T]
    st.row_hash.index_add_(0, rows, terms.T)
    st.row_hash.remainder_(p.T)

    fills = valid & ((positions + 1) % B == 0)  # this token completes its block
    if not when(fills.any()):
        return
    j = positions // B
    key = salted(table_key(prefix), st.sampling["cache_salt"][rows])
    parent = torch.where(j > 0, st.block_table[rows, (j - 1).clamp(min=0)].long(), N)
    # Several inserts into one slot this step: the oldest request wins (it is the one ahead
    # in FCFS order, so its chain keeps winning).
    prio = -(st.arrival[rows] * (cfg.max_blocks_per_seq + 1) + j)
    best = st.insert_best  # all INT64_MIN between steps; INT64_MAX marks a slot taken this step
    pending = fills
    won = torch.full_like(key, H)  # the slot each block took (H: none)
    blocks = slot_mapping // B  # each token's block
    for r in range(INSERT_ROUNDS):
        target, taken, free = _choose_slot(st, cfg, key, best, r)
        pending = pending & ~taken & free
        lanes = torch.where(pending, target, H)
        best.scatter_reduce_(0, lanes, torch.where(pending, prio, INT64_MIN), "amax")
        win = pending & (best[lanes] == prio)
        _enter(st, win, torch.where(win, target, H), blocks, key, parent, stamp)
        best.index_put_((lanes,), torch.full_like(lanes, INT64_MAX))  # every bid slot has its winner
        best[H:].fill_(INT64_MIN)  # slice fills, not ``t[i] = v`` (a tensor from Python data)
        won = torch.where(win, target, won)
        # A loser tries again in the next round, among the slots no block took this step,
        # unless the winner holds its own key (a key has at most one live entry).
        pending = pending & ~win & (st.block_key[st.hash_table[lanes]] != key)
    best.index_put_((won,), torch.full_like(won, INT64_MIN))  # (won is H where none: the sink too)


def _choose_slot(
    st: EngineState, cfg: SchedulerConfig, key: torch.Tensor, best: torch.Tensor, r: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each key's slot in its probe window, among the slots no block took this step
    (``best`` is INT64_MAX at those). A key has at most one live entry: if it is anchored (its
    parent is still the live entry of the previous key, or it is a first block) it is part of a
    reachable chain and is kept (``taken``: this block stays uncached). An orphaned entry is
    replaced. A new key takes the first dead slot, else the least recently used entry
    (entries of free cached blocks before those of blocks in use); "first" from the window's
    start in round ``r`` 0, from a point the key picks in later rounds. Returns (slot, taken,
    free: the window had a slot not taken this step)."""
    N, H, P = cfg.num_blocks, cfg.hash_table_size, cfg.prefix_probes
    k = torch.arange(P, device=key.device)
    if r > 0:  # a retry scans its window from a point its key picks, so that two losers of
        # one slot (one home) do not choose the same next slot again
        k = (k + ((key // H) >> (3 * r)).unsqueeze(-1)) % P
    probe = ((key % H).unsqueeze(-1) + k) % H
    occupant = st.hash_table[probe]
    live = st.block_slot[occupant] == probe
    same_key = live & (st.block_key[occupant] == key.unsqueeze(-1))
    up = st.block_parent[occupant]
    anchored = (up == N) | ((st.block_slot[up] >= 0) & (st.block_parent_gen[occupant] == st.block_gen[up]))
    in_use = (st.block_ref[occupant] > 0).long() << 62
    score = torch.where(same_key, -2, torch.where(live, st.block_last_used[occupant] + in_use, -1))
    score = torch.where(best[probe] == INT64_MAX, INT64_MAX, score)
    choice = score.argmin(1, keepdim=True)
    target = probe.gather(1, choice).squeeze(1)
    taken = (same_key & anchored).gather(1, choice).squeeze(1)
    free = score.gather(1, choice).squeeze(1) != INT64_MAX
    return target, taken, free


def _enter(
    st: EngineState, win: torch.Tensor, target: torch.Tensor, blk: torch.Tensor, key: torch.Tensor,
    parent: torch.Tensor, stamp: torch.Tensor,
) -> None:
    """The winners' table writes (``target``: their slots, H elsewhere): each evicts what its
    slot held, then the slot names its block and the block records its key, parent and
    stamp. Lanes that did not win write into the sinks (slot H, block N), restored after."""
    N, H = st.block_slot.shape[0] - 1, st.hash_table.shape[0] - 1
    blk = torch.where(win, blk, N)
    victim = st.hash_table[target]
    evicted = win & (st.block_slot[victim] == target)
    st.block_slot.index_put_((torch.where(evicted, victim, N),), torch.full_like(victim, -1))
    st.hash_table.index_put_((target,), blk)
    st.block_slot.index_put_((blk,), target)
    st.block_key.index_put_((blk,), key)
    st.block_parent.index_put_((blk,), parent)
    st.block_parent_gen.index_put_((blk,), st.block_gen[parent])
    st.block_slot[N:].fill_(-1)
    st.hash_table[H:].fill_(N)
    st.block_last_used.scatter_reduce_(0, blk, torch.where(win, stamp, 0), "amax")
