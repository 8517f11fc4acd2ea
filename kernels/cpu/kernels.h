/* Helpers shared by the CPU kernels (attention.c, fused.c, q4_linear.c; pool.c
 * for its types): bf16 <-> fp32, exps, the gated activation, and the split of a call's work
 * over the process's worker pool. Hashed into their build keys (blink/shared/native_build.py),
 * so a change here rebuilds them all. */
#pragma once
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) { /* bf16 is the top half of an fp32 */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* a * b + c with one rounding where the CPU has FMA (as _mm512_fmadd_ps, so the scalar
 * and vector exps below give the same bits), else two. */
static inline float blink_fma(float a, float b, float c) {
#if defined(__FMA__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* 2^f for f in [0, 1): the degree-6 polynomial's coefficients (highest first), shared by the
 * scalar and vector exps below so that they stay operation for operation the same */
#define EXP_C6 1.535336188319500e-4f
#define EXP_C5 1.339887440266574e-3f
#define EXP_C4 9.618437357674640e-3f
#define EXP_C3 5.550332471162809e-2f
#define EXP_C2 2.402264791363012e-1f
#define EXP_C1 6.931472028550421e-1f

/* exp(x) for x <= 0 in plain arithmetic (libm's expf is a call per element):
 * 2^(x log2 e) = 2^n * 2^f, 2^f by a degree-6 polynomial in multiply-adds; relative error
 * ~2e-7. Below -87 the result is clamped to exp(-87) ~ 1.6e-38, which no sum it enters can
 * tell from 0. p * 2^n is exact (n >= -126: a normal number). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    float t = x * 1.44269504088896341f;
    float n = floorf(t);
    float f = t - n; /* [0, 1) */
    float p = EXP_C6;
    p = blink_fma(p, f, EXP_C5);
    p = blink_fma(p, f, EXP_C4);
    p = blink_fma(p, f, EXP_C3);
    p = blink_fma(p, f, EXP_C2);
    p = blink_fma(p, f, EXP_C1);
    p = blink_fma(p, f, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_nonpositive above on 16 lanes, operation for operation (its bits where the including
 * file is built with -ffp-contract=off, so that GCC fuses no other product and sum; 2^n by
 * scalef, exact as the scalar code's). -inf gives exp(-87). The multiply-adds made the SiLU
 * 1.3x faster than a multiply and an add per term. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLINK_AVX2_EXP 1

/* exp_nonpositive above on 8 lanes (AVX2 builds), operation for operation: its bits, 2^n
 * formed from n's exponent bits as the scalar code forms it. The softmax of the paged
 * attention's per-token pass and the SiLU ran a scalar exp per element there (the SiLU 1.8x
 * slower than torch's). */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* 8 bf16 <-> 8 fp32 (AVX2 builds); the store rounds to nearest even as f32_to_bf16 does for
 * finite values (the SiLU's are) */
static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256i rounded_bf16_bits8(__m256 v) { /* each lane's bf16 in its top 16 bits */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
}

static inline __m256 round_bf16x8(__m256 v) { /* to bf16 and back: the rounding alone */
    return _mm256_castsi256_ps(_mm256_and_si256(rounded_bf16_bits8(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store_bf16x8(uint16_t *p, __m256 v) {
    const __m256i h = _mm256_srli_epi32(rounded_bf16_bits8(v), 16); /* 8 x 16 bits in 32-bit lanes */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* silu_times16 below on 8 lanes: (g < 0 ? g e : g) / (1 + e), e = exp(-|g|), rounded to bf16,
 * times u (its bits) */
static inline __m256 silu_times8(__m256 g, __m256 u) {
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, _mm256_set1_ps(-0.0f))); /* -|g| */
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative);
    return _mm256_mul_ps(round_bf16x8(_mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e))), u);
}
#endif

/* Whether this build has AVX-512 (each library that includes this exports it): without it
 * the kernels' 16-float vectors are emulated on narrower registers, and the paged attention's
 * per-token pass ran 2.5x slower a key (kernels/cpu/attention.py prices it so). */
int blink_has_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* 16 bf16 <-> 16 fp32 in one AVX-512 register, where the build has AVX512-BF16 (its store
 * rounds to nearest even, as f32_to_bf16 above, denormals flushed to zero). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
static inline __m512 load_bf16x16(const uint16_t *p) { /* bf16 is the top half of an fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 round_bf16x16(__m512 v) { /* to bf16 and back: the rounding alone */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* bf16(silu(g)) * u in fp32 for g, u holding bf16 values: the gated activation F.silu(gate)
 * * up in bf16 before its last rounding (fused.c's SiLU, and the 4-bit kernel's fused
 * gate/up epilogue, which therefore give the same bits). silu(g) = g / (1 + exp(-g)), taken
 * as (g < 0 ? g e : g) / (1 + e) with e = exp(-|g|) <= 1: exp of a large positive argument
 * made the vector code ~10x slower on some inputs (measured). One division straight to the
 * result, not a reciprocal and two products: 1.1x faster, one rounding fewer. */
static inline __m512 silu_times16(__m512 g, __m512 u) {
    const __m512 e = exp_nonpositive16(_mm512_or_ps(g, _mm512_set1_ps(-0.0f))); /* -|g| */
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
    return _mm512_mul_ps(round_bf16x16(_mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e))), u);
}
#endif

/* AMX, where the build has it (-march=native on a CPU with AMX-BF16): the tile configuration
 * and the permission Linux wants before a process touches tile data. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BLINK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* arch/x86/include/uapi/asm/prctl.h */
#define BLINK_ARCH_REQ_XCOMP_PERM 0x1023
#define BLINK_XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} blink_tile_config_t;

/* 1 where this process may use AMX (asked of the kernel once; Linux 5.16 and later). */
static inline int blink_amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, BLINK_ARCH_REQ_XCOMP_PERM, BLINK_XFEATURE_XTILEDATA) == 0;
    return granted;
}
#endif

/* One thread's share of a call: items [lo, hi) of the kernel's `args`; `status` its result
 * (0, or the kernel's error). */
typedef struct {
    const void *args;
    int64_t lo, hi;
    int status;
} blink_part_t;

enum { BLINK_MAX_THREADS = 64 };

/* The process's worker pool (kernels/cpu/pool.c, one for every kernel library, so that their
 * calls never wait for each other's workers), given to each library at load
 * (kernels/cpu/pool.py); NULL until then, or where it could not be built: calls run on the
 * calling thread. */
typedef int (*blink_pool_run_t)(void *(*run)(void *), const void *args, int64_t items, int threads, int64_t parts);
static blink_pool_run_t blink_pool_run = NULL;

void blink_use_pool(void *run) { blink_pool_run = (blink_pool_run_t)run; }

/* `threads`, fewer while the call's `work` is under `per_thread` units for each: a part must
 * pay for handing it to a worker (each kernel sizes its unit to ~5-15 us of its work). */
static inline int blink_threads_for(int64_t work, int64_t per_thread, int threads) {
    while (threads > 1 && work < (int64_t)threads * per_thread) threads--;
    return threads;
}

/* run(part) over [0, items) split evenly into `parts` parts (at least `threads`, at most
 * `items`) that up to `threads` threads (at most BLINK_MAX_THREADS) claim, on the pool when there
 * is one and more than one thread, else all items here in one part. Returns 0 or the last
 * nonzero status. Callers pick `threads` by the call's work, and more parts than threads only
 * where the parts' results do not depend on where the items were cut (each claimed part then
 * evens out the threads' speeds: one core slowed by another process's work, say). */
static inline int blink_run_parts_of(void *(*run)(void *), const void *args, int64_t items, int threads,
                                     int64_t parts) {
    if (threads > 1 && items > 1 && blink_pool_run != NULL) return blink_pool_run(run, args, items, threads, parts);
    blink_part_t part = {args, 0, items, 0};
    run(&part);
    return part.status;
}

/* blink_run_parts_of with one part a thread. */
static inline int blink_run_parts(void *(*run)(void *), const void *args, int64_t items, int threads) {
    return blink_run_parts_of(run, args, items, threads, threads);
}
