"""The scheduler's policy as a short per-request Python scheduler: read this file first.

:class:`blink.engine.sched.scheduler.Scheduler` runs this same policy as branch-free tensor
code over fixed-shape state (so it can live in a CUDA graph); this file says the same thing
with plain Python objects, in the style of nano-vllm and vLLM V1, and is the tests' oracle:
``tests/test_scheduler_reference.py`` drives both with the same arrivals, cancels, sampled
tokens and stream reads and checks, step by step, that they agree on which rows run, how
many tokens each gets, block counts, preemptions and finishes.

The model (vLLM V1's "no phases"): a request is ``num_computed`` of ``len(tokens)`` tokens
with KV in the cache. Prefill, chunked prefill, decode and recompute after preemption are all
"compute the next uncomputed tokens"; a request samples a token in a step that computes its
last known token.

Where a request lives:

- ``waiting``: requests the frontend has written into a ring slot, not admitted yet
  (a deque in arrival order: the ring's WRITTEN slots).
- ``rows``: engine row ``i`` serves ring slot ``i``. A row holds at most one request, in
  one of the states WAITING (admitted or preempted: nothing computed beyond prefix-cache
  hits), RUNNING (scheduled since), RELEASING (finished; its blocks are being dropped, a
  window per step; the slot's next request waits for the row to be EMPTY).
- ``running``: the WAITING and RUNNING requests, oldest arrival first. Unlike nano-vllm,
  there is one queue: the token budget and the blocks go by arrival (FCFS), and a preempted
  request keeps its place (it is recomputed from scratch, its tokens kept). Under
  ``scheduling_policy="priority"`` the queue (admission included) is ordered by (priority,
  arrival) instead (:meth:`ReferenceScheduler.key`), so a newly admitted urgent request is
  served before, and may preempt, less urgent running ones; everything below that says
  "oldest" / "youngest" means first / last in that order (prefix lookups included).

Not modelled here: disaggregation's KV reservations (kv_reserve.py), the stream payloads
(only their fill level, for backpressure), logprobs, and the hash table's limits (the prefix
cache here is a dict; the tensor code's open-addressing table with a probe window can fail
to register a block, and picks among equally old cached blocks in an unspecified order, so
the oracle compares prefix caching only where no cached block is evicted).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from blink.engine.sched.state import SchedulerConfig
from blink.ring import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

WAITING, RUNNING, RELEASING = "WAITING", "RUNNING", "RELEASING"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    """One request, as the frontend wrote it into ring slot ``slot``."""

    slot: int
    arrival: int  # the frontend's FCFS ticket
    prompt: list[int]
    max_tokens: int = 0  # <= 0: no limit
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    priority: int = 0  # under the priority policy: lower = served first (vLLM's)
    # Engine side.
    status: str = WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens with KV in the cache
    blocks: list[int] = field(default_factory=list)  # block ids, in sequence order
    needs_lookup: bool = False  # a prefix-cache lookup is pending
    cancelled: bool = False  # the frontend set the slot's cancel word
    produced: int = 0  # tokens published to the output stream
    consumed: int = 0  # tokens the frontend has read from it (set by the caller)
    finish: int | None = None  # FINISH_* once finished

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ReferenceScheduler:
    """The policy, one request at a time. ``schedule()`` returns ``{row: tokens}`` for the
    step; ``update({row: token})`` appends the sampled tokens and finishes requests."""

    def __init__(self, cfg: SchedulerConfig, num_slots: int, stream_capacity: int) -> None:
        self.cfg = cfg
        self.num_slots = num_slots
        self.stream_capacity = stream_capacity
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * num_slots
        self.step = 0
        self.preemptions = 0
        # The priority policy's urgency register (None: nothing seen): the most urgent
        # priority seen among the live requests within the last priority_urgent_window_steps
        # steps, and the steps since it was last seen (:meth:`_track_urgent`).
        self.urgent_priority: int | None = None
        self.urgent_age = 0
        self.finished: list[Request] = []  # in finishing order (aborted WRITTEN slots too)
        # Blocks: reference counts, and the LRU stamp of each (when it was last released or
        # hit, the tensor code's ``block_last_used``). A free block (ref 0) may still be cached.
        self.ref = [0] * cfg.num_blocks
        self.last_used = [0] * cfg.num_blocks
        # Prefix cache: the whole prefix up to a full block's end -> that block. A cached
        # block also records its parent (the block before it in the sequence that registered
        # it) and the parent's generation then (bumped whenever a block is reallocated): a
        # hit must follow exactly the chain of blocks hit before it.
        self.cache: dict[tuple[int, ...], int] = {}
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.parent: dict[int, tuple[int, int] | None] = {}  # block -> (parent, its gen)
        self.gen = [0] * cfg.num_blocks

    # ------------------------------------------------------------------ frontend side

    def add(self, req: Request) -> None:
        """The frontend wrote ``req`` into its slot (arrival order)."""
        req.tokens = list(req.prompt)
        self.waiting.append(req)

    def cancel(self, slot: int) -> None:
        """The frontend set ``slot``'s cancel word (for the request it holds now)."""
        for req in [*self.waiting, self.rows[slot]]:
            if req is not None and req.slot == slot and req.finish is None:
                req.cancelled = True

    def key(self, req: Request) -> tuple[int, ...]:
        """The queue order: arrival (fcfs), or (priority, arrival) under the priority
        policy (vLLM's: a lower priority value is served first, ties by arrival)."""
        return (req.priority, req.arrival) if self.cfg.scheduling_policy == "priority" else (req.arrival,)

    @property
    def running(self) -> list[Request]:
        """WAITING and RUNNING requests in queue order (:meth:`key`: oldest first under
        fcfs), the order of budget and blocks; preemption takes them from the end."""
        live = [r for r in self.rows if r is not None and r.status in (WAITING, RUNNING)]
        return sorted(live, key=self.key)

    def num_free_blocks(self) -> int:
        return sum(1 for n in self.ref if n == 0)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> dict[int, int]:
        """Cancel, release, admit, look up prefixes, then budget, blocks and preemption."""
        cfg = self.cfg
        self.step += 1
        for req in self.running:  # cancellation: within one step
            if req.cancelled:
                self._finish(req, FINISH_ABORT)
        self._release_finished()
        self._admit()
        if cfg.enable_prefix_caching:
            self._lookup()
        return self._allocate()

    def _stamp(self, j: int) -> int:
        """LRU stamp of block index ``j`` of a sequence now: later steps are newer; within a
        step deeper blocks are older (a released sequence is evicted tail first)."""
        M = self.cfg.max_blocks_per_seq
        return self.step * (M + 1) + (M - j)

    def _release_finished(self) -> None:
        """RELEASING rows drop their blocks, deepest first, at most ``release_window`` blocks
        per step over the rows in row order; a row with none left is EMPTY."""
        budget = self.cfg.release_window(self.num_slots)
        for i, req in enumerate(self.rows):
            if req is None or req.status != RELEASING:
                continue
            while req.blocks and budget > 0:
                self._drop(req.blocks.pop(), len(req.blocks))
                budget -= 1
            if not req.blocks:
                self.rows[i] = None

    def _drop(self, block: int, j: int) -> None:
        self.ref[block] -= 1
        self.last_used[block] = max(self.last_used[block], self._stamp(j))

    def _admit(self) -> None:
        """WRITTEN slots whose row is EMPTY: cancelled ones finish (ABORT); of the others,
        the ``max_admit_per_step`` oldest are taken while their prompts fit the copy window
        (``admit_window_tokens``); an empty prompt, or one leaving no room for an output
        token, finishes with ERROR (it uses no window)."""
        cfg = self.cfg
        ready = [r for r in self.waiting if self.rows[r.slot] is None]
        for req in ready:
            if req.cancelled:
                self.waiting.remove(req)
                self._done(req, FINISH_ABORT)
        candidates = sorted((r for r in ready if not r.cancelled), key=self.key)
        window = cfg.admit_window_tokens
        for req in candidates[: min(cfg.max_admit_per_step, self.num_slots)]:  # queue order
            valid = 1 <= len(req.prompt) < cfg.max_model_len
            need = len(req.prompt) if valid else 0
            if need > window:
                break  # nothing later in the queue order jumps it
            window -= need
            self.waiting.remove(req)
            if not valid:
                self._done(req, FINISH_ERROR)
                continue
            req.status, req.num_computed = WAITING, 0
            req.needs_lookup = cfg.enable_prefix_caching
            self.rows[req.slot] = req

    def _lookup(self) -> None:
        """Prefix cache: the oldest rows waiting for a lookup (at most ``max_admit_per_step``,
        as many as fit ``lookup_window_blocks``) take the longest cached prefix of full
        blocks, never their last token (its logits are needed)."""
        cfg, B = self.cfg, self.cfg.block_size
        pending = sorted((r for r in self.rows if r is not None and r.needs_lookup), key=self.key)
        window = cfg.lookup_window_blocks
        for req in pending[: min(cfg.max_admit_per_step, self.num_slots)]:
            eligible = (req.num_tokens - 1) // B
            if eligible > window:
                break
            window -= eligible
            for j in range(eligible):
                block = self.cache.get(tuple(req.tokens[: (j + 1) * B]))
                if block is None or self.parent[block] != self._link(req.blocks):
                    break
                req.blocks.append(block)
                self.ref[block] += 1
                self.last_used[block] = max(self.last_used[block], self._stamp(j))
            req.num_computed = len(req.blocks) * B
            req.needs_lookup = False

    def _allocate(self) -> dict[int, int]:
        """Token budget, blocks, preemption. Each request, oldest first, asks for all its
        uncomputed tokens (none if a lookup is pending or its output stream is full; under the
        priority policy, a prompt being prefilled after the first one asks for at most what
        is left of ``priority_other_prefill_tokens``) and gets what the budget has left (the
        last one a chunk; while a more urgent priority was seen within the last
        ``priority_urgent_window_steps`` steps, a less urgent prompt shares that bound even
        when it is the first; in a step where a request at that urgent level prefills, the
        less urgent ones ask for nothing, decode included). If the new blocks do not fit the
        free pool: serve the longest oldest-first prefix that would fit if everything younger
        were preempted (the request at the cut gets what is left), and preempt the shortest
        youngest-first suffix whose blocks cover the deficit."""
        cfg, B = self.cfg, self.cfg.block_size
        queue = self.running
        budget = cfg.max_num_batched_tokens
        # Under the priority policy the prompts being prefilled after the first one (in queue
        # order) share priority_other_prefill_tokens per step: one large prefill per step;
        # so does the first one when it is less urgent than urgent work seen recently.
        first_prefill, other_prefill = True, cfg.priority_other_prefill_tokens
        urgent_prefill = False
        if cfg.scheduling_policy == "priority":
            self._track_urgent(queue)
            # A step in which a request at the urgent level prefills carries no less urgent one.
            urgent_prefill = any(self._wants(r) > 0 and r.num_computed < len(r.prompt)
                                 and r.priority <= self.urgent_priority for r in queue)
        grant = []
        for req in queue:
            want = self._wants(req)
            if urgent_prefill and req.priority > self.urgent_priority:
                want = 0
            if cfg.scheduling_policy == "priority" and want > 0 and req.num_computed < len(req.prompt):
                if not first_prefill or req.priority > self.urgent_priority:
                    want = min(want, other_prefill)
                    other_prefill -= want
                first_prefill = False
            grant.append(min(want, budget))
            budget -= grant[-1]
        held = [len(r.blocks) for r in queue]

        def needs(grant: list[int]) -> list[int]:
            return [max(0, ceil_div(r.num_computed + g, B) - h) for r, g, h in zip(queue, grant, held)]

        need, free = needs(grant), self.num_free_blocks()
        if sum(need) > free:
            grant, preempt = self._cut(queue, grant, need, held, free)
            need = needs(grant)
            for req in preempt:  # recompute later: blocks back, tokens kept, place kept
                assert grant[queue.index(req)] == 0, "a preempted request got tokens"
                for j in reversed(range(len(req.blocks))):
                    self._drop(req.blocks[j], j)
                req.blocks, req.num_computed, req.status = [], 0, WAITING
                req.needs_lookup = cfg.enable_prefix_caching
                self.preemptions += 1
        for req, g, n in zip(queue, grant, need):
            for _ in range(n):
                req.blocks.append(self._take_block(len(req.blocks)))
            if g > 0:
                req.status = RUNNING
        return {req.slot: g for req, g in zip(queue, grant) if g > 0}

    def _wants(self, req: Request) -> int:
        """The tokens ``req`` asks for before the priority policy's bounds: all its uncomputed
        ones, none if a lookup is pending or its output stream is full."""
        room = req.produced - req.consumed < self.stream_capacity
        return req.num_tokens - req.num_computed if room and not req.needs_lookup else 0

    def _track_urgent(self, queue: list[Request]) -> None:
        """The urgency register: a live request as urgent as it or more (re)sets it; else it
        ages a step, and once it has aged ``priority_urgent_window_steps`` steps it takes the
        most urgent live priority now (None when nothing is live)."""
        seen = min((r.priority for r in queue), default=None)
        window = self.cfg.priority_urgent_window_steps
        if self.urgent_priority is None or (seen is not None and seen <= self.urgent_priority) \
                or self.urgent_age >= window:
            self.urgent_priority, self.urgent_age = seen, 0
        else:
            self.urgent_age += 1

    def _cut(self, queue, grant, need, held, free):
        """The preemption decision (the blocks do not fit). Returns the new grants and the
        requests to preempt."""
        B, n = self.cfg.block_size, len(queue)
        # freed[k]: blocks referenced by no request older than position k (what preempting
        # positions >= k frees). Blocks of RELEASING rows are freed by no preemption.
        first_user: dict[int, int] = {}
        for r in self.rows:
            if r is not None and r.status == RELEASING:
                for b in r.blocks:
                    first_user[b] = 0
        for pos, r in enumerate(queue):
            for b in r.blocks:
                first_user[b] = min(first_user.get(b, n), pos)
        freed = [sum(1 for p in first_user.values() if p >= k) for k in range(n + 1)]
        need_before = [sum(need[:k]) for k in range(n + 1)]
        # The oldest ``cut`` requests get all they asked for; the one at ``cut`` a chunk.
        cut = max((k for k in range(n + 1) if need_before[k] <= free + freed[k]), default=0)
        left = free + freed[min(cut + 1, n)] - need_before[cut]
        grant = list(grant)
        for pos in range(cut + 1, n):
            grant[pos] = 0
        if cut < n:
            fits = max(0, (held[cut] + max(left, 0)) * B - queue[cut].num_computed)
            grant[cut] = min(grant[cut], fits) if left >= 0 else 0
        need = [max(0, ceil_div(r.num_computed + g, B) - h) for r, g, h in zip(queue, grant, held)]
        deficit = sum(need) - free
        first = max((k for k in range(1, n + 1) if freed[k] >= deficit), default=0)
        return grant, [r for pos, r in enumerate(queue) if pos >= first and held[pos] > 0]

    def _take_block(self, j: int) -> int:
        """A free block for block index ``j``: never-cached ones first, then cached ones least
        recently used (evicted from the cache)."""
        free = [b for b in range(self.cfg.num_blocks) if self.ref[b] == 0]
        block = min(free, key=lambda b: (b in self.key_of, self.last_used[b] if b in self.key_of else 0))
        self._uncache(block)
        self.gen[block] += 1  # new content: blocks registered after it go stale
        self.ref[block] = 1
        self.last_used[block] = max(self.last_used[block], self._stamp(j))
        return block

    def _link(self, blocks: list[int]) -> tuple[int, int] | None:
        """What a block after ``blocks`` records as its parent: the last one, and its gen."""
        return (blocks[-1], self.gen[blocks[-1]]) if blocks else None

    def _uncache(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cache[key]

    def _register(self, filled: list[tuple[Request, int]]) -> None:
        """Enter the blocks a step filled ((request, block index) pairs) into the cache. A key
        already cached whose block is still anchored (a first block, or its parent cached
        with the same content) keeps its block; an orphaned one is replaced. Two requests
        filling the same key in one step: the older one's block is cached. All decided on the
        cache as it was before the step's inserts (the tensor code inserts them at once)."""
        B, inserts = self.cfg.block_size, {}
        for req, j in sorted(filled, key=lambda f: (f[0].arrival, f[1])):
            key = tuple(req.tokens[: (j + 1) * B])
            old = self.cache.get(key)
            if key not in inserts and (old is None or not self._anchored(old)):
                inserts[key] = (req.blocks[j], old, self._link(req.blocks[:j]))
        for key, (block, old, link) in inserts.items():
            if old is not None:
                self._uncache(old)
            self._uncache(block)
            self.cache[key], self.key_of[block], self.parent[block] = block, key, link

    def _anchored(self, block: int) -> bool:
        up = self.parent[block]
        return up is None or (up[0] in self.key_of and self.gen[up[0]] == up[1])

    # ------------------------------------------------------------------ after the forward

    def update(self, num_new: dict[int, int], sampled: dict[int, int]) -> None:
        """Account the step's tokens (``num_new``, as ``schedule`` returned) and append
        ``sampled`` ({row: token}; -1: no structured-output mask, finish with ERROR) to the
        rows that computed their last token. Finish: a stop id or EOS (unless ignore_eos),
        both only once ``min_tokens`` outputs exist; ``max_tokens``; ``max_model_len``."""
        cfg, B = self.cfg, self.cfg.block_size
        filled = []
        for row, n in num_new.items():
            req = self.rows[row]
            filled += [(req, j) for j in range(req.num_computed // B, (req.num_computed + n) // B)]
            req.num_computed += n
        if cfg.enable_prefix_caching:
            self._register(filled)
        for row in sorted(sampled):
            req, tok = self.rows[row], sampled[row]
            if tok < 0:
                self._finish(req, FINISH_ERROR)
                continue
            n_out = req.num_tokens - len(req.prompt)  # outputs before this one
            req.tokens.append(tok)
            req.produced += 1
            stops = set(req.stop_ids) | (set() if req.ignore_eos else set(cfg.eos_token_ids))
            if tok in stops and n_out >= req.min_tokens:
                self._finish(req, FINISH_STOP)
            elif (req.max_tokens > 0 and n_out + 1 >= req.max_tokens) or req.num_tokens >= cfg.max_model_len:
                self._finish(req, FINISH_LENGTH)

    def sample_rows(self, num_new: dict[int, int]) -> list[int]:
        """Rows that produce a token this step: those computing their last known token."""
        return sorted(row for row, n in num_new.items()
                      if self.rows[row].num_computed + n == self.rows[row].num_tokens)

    def _finish(self, req: Request, reason: int) -> None:
        req.status = RELEASING  # its blocks go back from the next step on
        req.needs_lookup = False
        self._done(req, reason)

    def _done(self, req: Request, reason: int) -> None:
        req.finish = reason
        self.finished.append(req)
