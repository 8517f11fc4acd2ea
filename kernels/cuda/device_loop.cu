// Tier B, the CPU-free device loop: the small kernels of one CUDA graph whose WHILE node
// repeats the engine step with no host call.
//
//   root:  WHILE(h_loop) {
//            blink_gate                       poll the ring (bounded), heartbeat, drain/stop;
//                                             sets h_step and h_loop
//            IF(h_step) {
//              [scheduler.schedule()]         torch ops, captured
//              blink_dispatch                 reads num_scheduled_tokens / bucket_index the
//                                             schedule wrote; sets h_bucket[0..n)
//              IF(h_bucket[b]) {              one per bucket, all after blink_dispatch
//                [forward(T_b) + sampler + scheduler.update()]   torch ops, captured
//                blink_publish_fence          fence.sc.sys: the step's ring writes are
//                                             visible system-wide before the next step
//              }
//            }
//          }
//
// Built by blink.engine.gpu_loop (cuda-bindings), compiled by blink.kernels.cuda.nvrtc_build
// (NVRTC, no -rdc: cudaGraphSetConditional is resolved by the driver at module load).
// Every kernel here is bounded: the gate polls at most max_polls times and at most
// poll_budget_ns; the others do a fixed amount of work.
#include "device_loop_common.cuh"

extern "C" __global__ void __launch_bounds__(BLINK_GATE_THREADS) blink_gate(BlinkLoopParams p) {
  int exit_reason = BLINK_EXIT_RUNNING;
  const int decision = blink_gate_poll(p, &exit_reason);
  if (threadIdx.x == 0) {
    blink_gate_record(p, decision, exit_reason);
    cudaGraphSetConditional((cudaGraphConditionalHandle)p.h_step, decision == BLINK_GATE_STEP ? 1u : 0u);
    cudaGraphSetConditional((cudaGraphConditionalHandle)p.h_loop, decision == BLINK_GATE_STOP ? 0u : 1u);
  }
}

extern "C" __global__ void blink_dispatch(BlinkLoopParams p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const int d = blink_dispatch_record(p);
  for (int i = 0; i < p.n_buckets; ++i) {
    cudaGraphSetConditional((cudaGraphConditionalHandle)p.h_bucket[i], i == d ? 1u : 0u);
  }
}

// Release point of a step: every write the step made (output streams, produced counters,
// finish reasons, state words, stats) is ordered before anything written after it.
extern "C" __global__ void blink_publish_fence() {
  if (threadIdx.x == 0 && blockIdx.x == 0) blink_fence_sc_sys();
}
