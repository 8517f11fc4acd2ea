"""Compile the fused scheduler's Triton stages (kernels/triton/sched.py) for a GPU target on a
machine without a GPU: one captured step's launches (``schedule()`` and ``update()`` with
``host_guards=False``, as the device loop captures them) are recorded with
:func:`blink.kernels.triton.compile_check.record_launches` and each distinct one is compiled
to a cubin. The interpreter tests check what these kernels compute, not what the GPU compiler
accepts. Run by tests/test_kernels_compile.py in a process without ``TRITON_INTERPRET``:

    python tests/sched_compile_check.py [--arch 90]

Prints :func:`blink.kernels.triton.compile_check.print_reports`' table (a kernel a line, its
spill bytes last) and the count of errors; exits 1 on any. The step's shape is a production
one: 256 slots, an 8,192-token budget and model length, 16,384 blocks of 16 tokens (the fused
allocator's largest pool: it sorts the whole pool in one program).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter never compiles kernels")
sys.path.insert(0, str(Path(__file__).parent))  # the scheduler tests' ring and frontend

import torch  # noqa: E402

import test_scheduler as ts  # noqa: E402
from blink.engine.sched.scheduler import Scheduler  # noqa: E402
from blink.engine.sched.state import SchedulerConfig, ring_tensors  # noqa: E402
from blink.kernels.triton.compile_check import compile_unique, print_reports, record_launches  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 or 80")
    args = parser.parse_args(argv)
    cfg = SchedulerConfig(block_size=16, num_blocks=16384, max_model_len=8192, max_num_batched_tokens=8192,
                          max_admit_per_step=16, enable_prefix_caching=True, eos_token_ids=(2,))
    ring = ts.make_ring(256, cfg.max_model_len, 16)
    with record_launches(args.arch, lambda: "scheduler step") as launches:
        sched = Scheduler(cfg, ring_tensors(ring), host_guards=False, fused=True)
        batch = sched.schedule()
        rows = batch.sample_rows.shape[0]
        sched.update(batch, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows),
                     torch.zeros(rows, 0, dtype=torch.int64), torch.zeros(rows, 0))
    return 1 if print_reports(compile_unique(launches, args.arch), args.arch) else 0

if __name__ == "__main__":
    sys.exit(main())
