// The decisions the device loop's small kernels make, as pure functions of their inputs.
//
// Kept free of device intrinsics so the same code compiles for the host: the test suite
// builds it with the host C++ compiler and checks it against the Python model in
// blink/engine/graphs.py (``gate_decide`` / ``dispatch_bucket``), which the CPU simulation of
// tier B runs. Any change here must be made there too (the test fails otherwise).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BLINK_HD __host__ __device__ __forceinline__
#else
#define BLINK_HD static inline
#endif

// Host stop requests (engine-private control word HC_STOP).
#define BLINK_STOP_NONE 0
#define BLINK_STOP_DRAIN 1
#define BLINK_STOP_NOW 2

// Gate decisions.
#define BLINK_GATE_WAIT 0  // keep polling (only inside the bounded poll loop)
#define BLINK_GATE_STEP 1  // run one engine step (schedule, then the bucket's forward)
#define BLINK_GATE_IDLE 2  // nothing to do within the poll budget: next loop iteration
#define BLINK_GATE_STOP 3  // leave the loop

// Exit reasons (loop-state word LS_EXIT).
#define BLINK_EXIT_RUNNING 0
#define BLINK_EXIT_STOPPED 1        // immediate stop asked by the host
#define BLINK_EXIT_DRAINED 2        // drain asked and every slot is FREE
#define BLINK_EXIT_DRAIN_TIMEOUT 3  // drain asked, requests still in flight at the deadline

typedef struct BlinkGateInput {
  long long now_ns;            // %globaltimer now
  long long start_ns;          // when this gate invocation started polling
  long long last_empty_ns;     // when the last dispatched step had no token (0 = never)
  long long drain_start_ns;    // when draining began (0 = not draining)
  long long poll_budget_ns;    // longest one gate invocation polls before returning IDLE
  long long empty_backoff_ns;  // after an empty step, wait this long unless new work comes
  long long drain_timeout_ns;  // longest drain
  int stop_request;            // BLINK_STOP_*
  int shutdown;                // ring control word C_SHUTDOWN != 0 (drain)
  int any_busy;                // some slot is not FREE
  int any_new;                 // some slot is WRITTEN, or a busy slot has its cancel flag set
  int last_step_empty;         // the last dispatched step scheduled no token
  int polls;                   // polls done so far in this invocation
  int max_polls;               // iteration cap of one invocation
} BlinkGateInput;

// One poll's decision. *exit_reason gets BLINK_EXIT_* when the decision is STOP.
BLINK_HD int blink_gate_decide(const BlinkGateInput* in, int* exit_reason) {
  *exit_reason = BLINK_EXIT_RUNNING;
  if (in->stop_request == BLINK_STOP_NOW) {
    *exit_reason = BLINK_EXIT_STOPPED;
    return BLINK_GATE_STOP;
  }
  const int draining = in->stop_request == BLINK_STOP_DRAIN || in->shutdown != 0;
  if (draining) {
    if (!in->any_busy) {
      *exit_reason = BLINK_EXIT_DRAINED;
      return BLINK_GATE_STOP;
    }
    if (in->drain_start_ns != 0 && in->now_ns - in->drain_start_ns > in->drain_timeout_ns) {
      *exit_reason = BLINK_EXIT_DRAIN_TIMEOUT;
      return BLINK_GATE_STOP;
    }
  }
  if (in->any_busy &&
      (in->any_new || !in->last_step_empty || in->now_ns - in->last_empty_ns >= in->empty_backoff_ns)) {
    return BLINK_GATE_STEP;
  }
  if (in->polls + 1 >= in->max_polls || in->now_ns - in->start_ns >= in->poll_budget_ns) {
    return BLINK_GATE_IDLE;
  }
  return BLINK_GATE_WAIT;
}

// The bucket body to run after a schedule: the bucket index the scheduler computed, or -1
// (run none) when the step has no token or the index is out of range.
BLINK_HD int blink_dispatch_bucket(long long num_scheduled_tokens, long long bucket_index, int n_buckets) {
  if (num_scheduled_tokens <= 0) return -1;
  if (bucket_index < 0 || bucket_index >= n_buckets) return -1;
  return (int)bucket_index;
}

// Sleep between polls: doubles from 256 ns up to max_ns (bounded exponential back-off).
BLINK_HD unsigned int blink_poll_sleep_ns(int polls, unsigned int max_ns) {
  unsigned int ns = 256u;
  for (int i = 0; i < polls && ns < max_ns; ++i) ns <<= 1;
  return ns < max_ns ? ns : max_ns;
}
