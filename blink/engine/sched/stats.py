"""Stats: the gauges and counters mirrored into the ring control block at the end of every
step (``update``, or ``schedule`` when nothing was scheduled)."""
from __future__ import annotations

import torch

from blink.engine.sched.state import (
    K_GENERATED_TOKENS,
    K_PREEMPTIONS,
    K_PREFIX_HITS,
    K_PREFIX_QUERIES,
    K_PROMPT_TOKENS,
    K_STEPS,
    ROW_EMPTY,
    ROW_RELEASING,
    ROW_RUNNING,
    ROW_WAITING,
)
from blink.ring import (
    C_STAT_GENERATED_TOKENS,
    C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_KV_BLOCKS_USED,
    C_STAT_PREEMPTIONS,
    C_STAT_PREFIX_HITS,
    C_STAT_PREFIX_QUERIES,
    C_STAT_PROMPT_TOKENS,
    C_STAT_RUNNING,
    C_STAT_STEPS,
    C_STAT_WAITING,
    SLOT_WRITTEN,
)

#: the control-block words ``_write_stats`` writes, in the order of its values
STAT_WORDS = (
    C_STAT_RUNNING, C_STAT_WAITING, C_STAT_KV_BLOCKS_USED, C_STAT_KV_BLOCKS_TOTAL,
    C_STAT_PREFIX_QUERIES, C_STAT_PREFIX_HITS, C_STAT_PREEMPTIONS, C_STAT_STEPS,
    C_STAT_PROMPT_TOKENS, C_STAT_GENERATED_TOKENS,
)


class Stats:
    """The stats stage of :class:`blink.engine.sched.scheduler.Scheduler` (a mixin: it uses
    the scheduler's state, ring views and row window)."""

    def _write_stats(self) -> None:
        """Mirror the gauges and counters into the ring control block."""
        w, cfg = self._w, self.config
        st = w.state
        if "stats" in self.fused:
            self._triton.write_stats(st.status, w.ring["state"], st.block_ref, st.counters, self.ring["control"],
                                     self._stat_words, cfg.num_blocks, self._stat_consts)
            return
        if self._c is not None:  # the CPU loop: one C call (kernels/cpu/sched.c)
            self._c.write_stats(st, w.ring["state"], self.ring["control"])
            return
        unadmitted = ((w.ring["state"] == SLOT_WRITTEN)
                      & ((st.status == ROW_EMPTY) | (st.status == ROW_RELEASING))).sum()
        c = st.counters
        values = torch.stack([
            (st.status == ROW_RUNNING).sum(),
            (st.status == ROW_WAITING).sum() + unadmitted,
            (st.block_ref[: cfg.num_blocks] > 0).sum(),
            torch.full_like(c[0], cfg.num_blocks),
            c[K_PREFIX_QUERIES], c[K_PREFIX_HITS], c[K_PREEMPTIONS], c[K_STEPS],
            c[K_PROMPT_TOKENS], c[K_GENERATED_TOKENS],
        ])
        self.ring["control"][self._stat_words] = values
