// What the device loop's kernels share: the parameter block, the loop-state words and the
// gate's bounded poll of the ring. The Python mirror of BlinkLoopParams is
// blink.engine.gpu_loop.LoopParams (a ctypes.Structure); BLINK_LOOP_PARAMS_BYTES pins the
// layout on both sides (the suite checks it).
#pragma once

#include "blink_memory_order.cuh"
#include "device_loop_logic.cuh"

#ifdef __CUDACC_RTC__
// NVRTC has the runtime's types but not the device runtime's function declarations.
// These are the declarations of cuda_device_runtime_api.h; the driver resolves them when
// the module is loaded (no -rdc, no libcudadevrt needed for these two).
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __device__ cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
#ifndef cudaStreamGraphTailLaunch
#define cudaStreamGraphTailLaunch (cudaStream_t)0x0100000000000000
#define cudaStreamGraphFireAndForget (cudaStream_t)0x0200000000000000
#endif
static __device__ __forceinline__ cudaGraphExec_t blink_current_graph_exec() {
  unsigned long long g;
  asm("mov.u64 %0, %%current_graph_exec;" : "=l"(g));
  return (cudaGraphExec_t)g;
}
#else
#include <cuda_runtime.h>
static __device__ __forceinline__ cudaGraphExec_t blink_current_graph_exec() { return cudaGetCurrentGraphExec(); }
#endif

#define BLINK_MAX_BUCKETS 32
#define BLINK_GATE_THREADS 256

// Loop-state words: int64[BLINK_LS_WORDS] in device memory, owned by the loop's kernels.
#define BLINK_LS_GATE_CALLS 0
#define BLINK_LS_IDLE_CALLS 1
#define BLINK_LS_STEPS 2           // dispatched steps with tokens
#define BLINK_LS_EMPTY_STEPS 3     // dispatched schedules with no token
#define BLINK_LS_LAST_STEP_EMPTY 4
#define BLINK_LS_LAST_EMPTY_NS 5
#define BLINK_LS_DRAIN_START_NS 6
#define BLINK_LS_LAST_HEARTBEAT_NS 7
#define BLINK_LS_EXIT 8            // BLINK_EXIT_*
#define BLINK_LS_LAST_BUCKET 9
#define BLINK_LS_LAUNCHES 10       // device graph launches (persistent-launcher variant)
#define BLINK_LS_RELAUNCHES 11     // tail self-relaunches (persistent-launcher variant)
#define BLINK_LS_WORDS 16

// Engine-private host words: int64[BLINK_HC_WORDS] of pinned host memory mapped into the
// GPU. The host engine writes them; the loop only reads.
#define BLINK_HC_STOP 0  // BLINK_STOP_*
#define BLINK_HC_WORDS 8

// Exit reason of the persistent-launcher variant when a launched graph never signalled.
#define BLINK_EXIT_HUNG 4

typedef struct BlinkLoopParams {
  long long* control;                      // ring control block, int64[CONTROL_WORDS]
  const int* slot_state;                   // ring slot state words, int32[n_slots]
  const int* slot_cancel;                  // ring slot cancel flags, int32[n_slots]
  const long long* host_ctl;               // engine-private host words
  long long* loop_state;                   // device memory, int64[BLINK_LS_WORDS]
  const long long* num_scheduled_tokens;   // the scheduler's 0-d output
  const long long* bucket_index;           // the scheduler's 0-d output
  long long poll_budget_ns;
  long long heartbeat_period_ns;
  long long empty_backoff_ns;
  long long drain_timeout_ns;
  int n_slots;
  int n_buckets;
  int max_polls;
  int max_sleep_ns;
  int c_engine_state;  // control word indices and values, from blink.ring
  int c_heartbeat;
  int c_shutdown;
  int engine_draining;
  int engine_stopped;
  int engine_failed;
  int slot_free;
  int slot_written;
  unsigned long long h_loop;  // cudaGraphConditionalHandle of the WHILE node
  unsigned long long h_step;  // ... of the IF node around the step
  unsigned long long h_bucket[BLINK_MAX_BUCKETS];  // ... of each bucket's IF node
} BlinkLoopParams;

#define BLINK_LOOP_PARAMS_BYTES (7 * 8 + 4 * 8 + 12 * 4 + 2 * 8 + BLINK_MAX_BUCKETS * 8)
static_assert(sizeof(BlinkLoopParams) == BLINK_LOOP_PARAMS_BYTES, "BlinkLoopParams layout changed");

// The gate's bounded poll, run by a whole block (BLINK_GATE_THREADS threads). Returns
// STEP, IDLE or STOP (never WAIT) and, for STOP, the exit reason. Bounded by max_polls
// iterations and by poll_budget_ns of %globaltimer, whichever comes first. Bumps the
// heartbeat every heartbeat_period_ns, marks the engine DRAINING when a drain begins.
static __device__ int blink_gate_poll(const BlinkLoopParams& p, int* exit_reason) {
  __shared__ int s_decision;
  __shared__ int s_exit;
  long long* ls = p.loop_state;
  const long long start = blink_globaltimer_ns();
  int decision = BLINK_GATE_WAIT;
  for (int polls = 0; polls < p.max_polls; ++polls) {
    int busy = 0, fresh = 0;
    for (int i = threadIdx.x; i < p.n_slots; i += blockDim.x) {
      const int st = blink_ld_relaxed_sys_s32(p.slot_state + i);
      const int cancel = blink_ld_relaxed_sys_s32(p.slot_cancel + i);
      busy |= st != p.slot_free;
      fresh |= st == p.slot_written || (st != p.slot_free && cancel != 0);
    }
    busy = __syncthreads_or(busy);
    fresh = __syncthreads_or(fresh);
    blink_fence_acq_rel_sys();  // the relaxed loads above become acquire loads
    if (threadIdx.x == 0) {
      const long long now = blink_globaltimer_ns();
      if (now - ls[BLINK_LS_LAST_HEARTBEAT_NS] >= p.heartbeat_period_ns) {
        long long* hb = p.control + p.c_heartbeat;
        blink_st_relaxed_sys_s64(hb, blink_ld_relaxed_sys_s64(hb) + 1);
        ls[BLINK_LS_LAST_HEARTBEAT_NS] = now;
      }
      BlinkGateInput in;
      in.now_ns = now;
      in.start_ns = start;
      in.last_empty_ns = ls[BLINK_LS_LAST_EMPTY_NS];
      in.poll_budget_ns = p.poll_budget_ns;
      in.empty_backoff_ns = p.empty_backoff_ns;
      in.drain_timeout_ns = p.drain_timeout_ns;
      in.stop_request = (int)blink_ld_acquire_sys_s64(p.host_ctl + BLINK_HC_STOP);
      in.shutdown = blink_ld_acquire_sys_s64(p.control + p.c_shutdown) != 0;
      in.any_busy = busy;
      in.any_new = fresh;
      in.last_step_empty = (int)ls[BLINK_LS_LAST_STEP_EMPTY];
      in.polls = polls;
      in.max_polls = p.max_polls;
      const int draining = in.stop_request == BLINK_STOP_DRAIN || in.shutdown;
      if (draining && ls[BLINK_LS_DRAIN_START_NS] == 0) {
        ls[BLINK_LS_DRAIN_START_NS] = now;
        blink_st_release_sys_s64(p.control + p.c_engine_state, p.engine_draining);
      }
      in.drain_start_ns = ls[BLINK_LS_DRAIN_START_NS];
      int reason = BLINK_EXIT_RUNNING;
      s_decision = blink_gate_decide(&in, &reason);
      s_exit = reason;
    }
    __syncthreads();
    decision = s_decision;
    if (decision != BLINK_GATE_WAIT) break;
    if (threadIdx.x == 0) blink_sleep_ns(blink_poll_sleep_ns(polls, (unsigned int)p.max_sleep_ns));
    __syncthreads();
  }
  if (decision == BLINK_GATE_WAIT) decision = BLINK_GATE_IDLE;  // iteration cap
  *exit_reason = s_exit;
  return decision;
}

// Thread 0 only: book-keeping of a gate decision; on STOP publishes the exit reason and
// the STOPPED engine state (everything before it fenced at system scope).
static __device__ void blink_gate_record(const BlinkLoopParams& p, int decision, int exit_reason) {
  long long* ls = p.loop_state;
  ls[BLINK_LS_GATE_CALLS] += 1;
  if (decision == BLINK_GATE_IDLE) ls[BLINK_LS_IDLE_CALLS] += 1;
  if (decision == BLINK_GATE_STOP) {
    ls[BLINK_LS_EXIT] = exit_reason;
    blink_fence_sc_sys();
    blink_st_release_sys_s64(p.control + p.c_engine_state, p.engine_stopped);
  }
}

// Thread 0 only: the bucket to run after a schedule, with book-keeping.
static __device__ int blink_dispatch_record(const BlinkLoopParams& p) {
  long long* ls = p.loop_state;
  const int d = blink_dispatch_bucket(*p.num_scheduled_tokens, *p.bucket_index, p.n_buckets);
  ls[BLINK_LS_LAST_BUCKET] = d;
  if (d < 0) {
    ls[BLINK_LS_EMPTY_STEPS] += 1;
    ls[BLINK_LS_LAST_STEP_EMPTY] = 1;
    ls[BLINK_LS_LAST_EMPTY_NS] = blink_globaltimer_ns();
  } else {
    ls[BLINK_LS_STEPS] += 1;
    ls[BLINK_LS_LAST_STEP_EMPTY] = 0;
  }
  return d;
}
