// Memory-ordering helpers for words shared with another agent (the frontend process, a
// DPU writing over RDMA, the host engine thread) while a kernel runs.
//
// The ring lives in pinned host memory mapped into the GPU (loopback frontend) or in GPU
// memory (RDMA/GPUDirect). Either way the other side is outside the GPU, so every ordering
// here is at system scope (.sys):
//   - readers of a state word use ld.acquire.sys: payload reads after it cannot be
//     satisfied before it (the frontend writes payload, fence, then the state word);
//   - writers of a state word use st.release.sys: payload written before it is visible
//     to the frontend before the state word is;
//   - fence.sc.sys orders everything a kernel wrote (e.g. a whole step's output stream)
//     before anything it or a later kernel writes.
// No atomics on mapped host memory: PCIe hosts without hostNativeAtomicSupported do not
// give system-scope read-modify-write on it. Every word here has a single writer on the
// GPU side (the heartbeat, engine state, per-slot words), so plain stores suffice.
//
// Generic addressing (no .global): a mapped host pointer and a device pointer both work.
// Needs sm_70 (PTX ISA 6.0) for the .acquire/.release/.relaxed qualifiers and %globaltimer
// reads; __nanosleep needs sm_70 too.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

#define BLINK_DEV __device__ __forceinline__

BLINK_DEV int blink_ld_acquire_sys_s32(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

BLINK_DEV long long blink_ld_acquire_sys_s64(const long long* p) {
  long long v;
  asm volatile("ld.acquire.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

BLINK_DEV int blink_ld_relaxed_sys_s32(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

BLINK_DEV long long blink_ld_relaxed_sys_s64(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

BLINK_DEV void blink_st_release_sys_s32(int* p, int v) {
  asm volatile("st.release.sys.b32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}

BLINK_DEV void blink_st_release_sys_s64(long long* p, long long v) {
  asm volatile("st.release.sys.b64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

BLINK_DEV void blink_st_relaxed_sys_s64(long long* p, long long v) {
  asm volatile("st.relaxed.sys.b64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

// Sequentially consistent fence at system scope (what __threadfence_system() means).
BLINK_DEV void blink_fence_sc_sys() { asm volatile("fence.sc.sys;" : : : "memory"); }

// Acquire-release fence at system scope: after a batch of relaxed loads it makes them
// acquire loads; before a batch of relaxed stores it makes them release stores.
BLINK_DEV void blink_fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" : : : "memory"); }

// Nanoseconds from the GPU's global timer (its resolution is about a microsecond on some
// parts: use it for timeouts, not for fine timing).
BLINK_DEV long long blink_globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (long long)t;
}

BLINK_DEV void blink_sleep_ns(unsigned int ns) { __nanosleep(ns); }

#endif  // __CUDACC__ || __CUDACC_RTC__
