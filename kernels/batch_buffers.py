"""The step batch's tensors, allocated once, which the scheduler's batch-build kernels fill
(the fused Triton stage, ``blink.kernels.triton.sched``, and the CPU loop's C stage,
``blink.kernels.cpu.sched``). A captured graph's outputs live at fixed addresses anyway; the
CPU loop consumes a batch before it schedules the next."""
from __future__ import annotations

import torch


class BatchBuffers:
    """Flat per-token arrays of the token budget T, per-row arrays of the S rows, and the
    step's scalars (0-d)."""

    def __init__(self, S: int, T: int, device: torch.device) -> None:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.seq_idx, self.slot_mapping = z(T), z(T), z(T), z(T)
        self.query_start_loc, self.seq_lens = z(S + 1, dtype=torch.int32), z(S, dtype=torch.int32)
        self.total, self.bucket, self.num_sample_rows = z(), z(), z()
        self.sample_rows, self.logits_indices = z(S), z(S)
