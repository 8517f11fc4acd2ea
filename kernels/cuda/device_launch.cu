// Tier B, alternative mechanism (Blink's): a persistent scheduler kernel that launches the
// pre-captured graphs from the device.
//
//   host, once:  cudaGraphLaunch(G_launcher)          G_launcher = [blink_launcher]
//   blink_launcher, one execution:
//     repeat while launches + 2 <= max_launches (the per-execution fire-and-forget limit):
//       gate (the same bounded poll as device_loop.cu)          STOP -> return, no relaunch
//       STEP: fire-and-forget G_schedule;  wait for its done ticket (bounded)
//             d = dispatch(num_scheduled_tokens, bucket_index)
//             d >= 0: fire-and-forget G_bucket[d]; wait for its done ticket (bounded)
//       IDLE: count it; after max_idle_rounds idle rounds leave the loop (bounds the
//             kernel's lifetime even when nothing happens)
//     cudaGraphLaunch(current graph, cudaStreamGraphTailLaunch)     self-relaunch: runs
//     once this execution and all its fire-and-forget work are done, and resets the
//     fire-and-forget count
//
// Requirements (checked on the host, see blink.engine.gpu_loop): every graph instantiated
// with cudaGraphInstantiateFlagDeviceLaunch and uploaded; each of G_schedule and
// G_bucket[*] ends with blink_graph_done(ticket), which bumps a device-memory ticket with
// release semantics; the launcher waits for it with acquire loads, bounded by
// wait_timeout_ns (a hang marks the engine FAILED and stops the loop instead of spinning
// forever). cudaGraphLaunch from the device is resolved by the driver at module load like
// cudaGraphSetConditional (no -rdc needed with CUDA 12+ per the compile test; unverified on
// a GPU).
//
// Not the default tier B (see blink/engine/gpu_loop.py): it relies on a spinning kernel
// co-running with the graphs it launched (forward progress on a partly occupied GPU), on
// the fire-and-forget limit, and on device-launch restrictions for every captured graph.
#include "device_loop_common.cuh"

typedef struct BlinkLauncherParams {
  BlinkLoopParams loop;                        // ring words, host words, loop state (handles unused)
  unsigned long long schedule_exec;            // cudaGraphExec_t, device-launchable
  unsigned long long bucket_exec[BLINK_MAX_BUCKETS];
  long long* ticket;                           // device memory, bumped by blink_graph_done
  long long wait_timeout_ns;
  int max_launches;                            // fire-and-forget launches per execution (<= 120)
  int max_idle_rounds;                         // idle gate rounds per execution
} BlinkLauncherParams;

// Appended to every graph the launcher launches: a release increment of the ticket.
extern "C" __global__ void blink_graph_done(long long* ticket) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  blink_fence_sc_sys();
  atomicAdd((unsigned long long*)ticket, 1ull);
}

// Thread 0: wait until *ticket >= target (acquire), at most timeout_ns. 1 = done.
static __device__ int blink_wait_ticket(const long long* ticket, long long target, long long timeout_ns,
                                        int max_sleep_ns) {
  const long long start = blink_globaltimer_ns();
  for (int polls = 0;; ++polls) {
    if (blink_ld_acquire_sys_s64(ticket) >= target) return 1;
    if (blink_globaltimer_ns() - start > timeout_ns) return 0;
    blink_sleep_ns(blink_poll_sleep_ns(polls, (unsigned int)max_sleep_ns));
  }
}

extern "C" __global__ void __launch_bounds__(BLINK_GATE_THREADS) blink_launcher(BlinkLauncherParams lp) {
  const BlinkLoopParams& p = lp.loop;
  // Loop control lives in shared memory: every thread of the block takes part in the
  // gate's poll (__syncthreads inside), so all must agree on when to leave.
  __shared__ int s_stop, s_launches, s_idle_rounds;
  long long* ls = p.loop_state;
  if (threadIdx.x == 0) {
    s_stop = 0;
    s_launches = 0;
    s_idle_rounds = 0;
  }
  __syncthreads();
  while (s_launches + 2 <= lp.max_launches && s_idle_rounds < lp.max_idle_rounds) {
    int exit_reason = BLINK_EXIT_RUNNING;
    const int decision = blink_gate_poll(p, &exit_reason);
    if (threadIdx.x == 0) {
      blink_gate_record(p, decision, exit_reason);
      if (decision == BLINK_GATE_STOP) {
        s_stop = 1;
      } else if (decision == BLINK_GATE_IDLE) {
        s_idle_rounds += 1;
      } else {
        long long target = blink_ld_acquire_sys_s64(lp.ticket) + 1;
        cudaGraphLaunch((cudaGraphExec_t)lp.schedule_exec, cudaStreamGraphFireAndForget);
        s_launches += 1;
        ls[BLINK_LS_LAUNCHES] += 1;
        int ok = blink_wait_ticket(lp.ticket, target, lp.wait_timeout_ns, p.max_sleep_ns);
        if (ok) {
          const int d = blink_dispatch_record(p);
          if (d >= 0) {
            target += 1;
            cudaGraphLaunch((cudaGraphExec_t)lp.bucket_exec[d], cudaStreamGraphFireAndForget);
            s_launches += 1;
            ls[BLINK_LS_LAUNCHES] += 1;
            ok = blink_wait_ticket(lp.ticket, target, lp.wait_timeout_ns, p.max_sleep_ns);
          }
        }
        if (!ok) {  // a launched graph never finished: fail loudly, never spin forever
          ls[BLINK_LS_EXIT] = BLINK_EXIT_HUNG;
          blink_fence_sc_sys();
          blink_st_release_sys_s64(p.control + p.c_engine_state, p.engine_failed);
          s_stop = 1;
        }
      }
    }
    __syncthreads();
    if (s_stop) return;
  }
  if (threadIdx.x == 0) {
    ls[BLINK_LS_RELAUNCHES] += 1;
    cudaGraphLaunch(blink_current_graph_exec(), cudaStreamGraphTailLaunch);
  }
}
