/* y = x @ W.T for a few bf16 rows against a weight kept as ggml Q8_0 codes, read as stored.
 *
 * W[n, k] = scale[n, k / 32] * codes[n, k] (int8 codes, one fp32 scale per 32: the file's
 * own values, exactly). A decode step of a few rows is bound by the bytes it reads; the
 * Q8_0 codes are half the bytes of the bf16 weight (SmolLM2's 49152 x 576 tied head: 28 MiB
 * + 3.4 MiB of scales instead of 54 MiB). Accumulation is fp32; the output is rounded to
 * bf16 once. Built at first use by blink/models/q8_linear.py, whose torch reference the
 * tests compare it with.
 */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_ROWS = 16, MAX_THREADS = 64, GROUP = 32, W = 16 };

typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

typedef struct {
    const float *x;        /* [M, K] fp32 copy of the input rows */
    const int8_t *codes;   /* [N, K] */
    const float *scales;   /* [N, K / GROUP] */
    uint16_t *out;         /* [M, out_stride] bf16 */
    int64_t M, K, out_stride, lo, hi;
} part_t;

static inline float hsum(vf v) {
    vf8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
    vf4 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; no NaN from finite codes */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* 16 int8 codes as floats. Intrinsics where the host has them: GCC 12 turns both
 * __builtin_convertvector of an int8 vector and an element loop into scalar conversions
 * (measured 7x slower for the whole product). */
static inline vf load_codes(const int8_t *p) {
    vf v;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < W; i++) v[i] = (float)p[i];
#endif
    return v;
}

/* Output columns [lo, hi), `M` constant when inlined from run_part. */
static inline __attribute__((always_inline)) void columns(const part_t *p, const int64_t M) {
    const int64_t K = p->K, groups = K / GROUP;
    for (int64_t n = p->lo; n < p->hi; n++) {
        const int8_t *row = p->codes + n * K;
        const float *scale = p->scales + n * groups;
        vf acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = (vf){0};
        for (int64_t g = 0; g < groups; g++) {
            vf w0 = load_codes(row + g * GROUP) * scale[g];
            vf w1 = load_codes(row + g * GROUP + W) * scale[g];
            for (int64_t m = 0; m < M; m++) {
                vf x0, x1;
                memcpy(&x0, p->x + m * K + g * GROUP, sizeof x0);
                memcpy(&x1, p->x + m * K + g * GROUP + W, sizeof x1);
                acc[m] += w0 * x0 + w1 * x1;
            }
        }
        for (int64_t m = 0; m < M; m++) p->out[m * p->out_stride + n] = f32_to_bf16(hsum(acc[m]));
    }
}

static void *run_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    switch (p->M) { /* the common row counts with a constant loop bound */
    case 1: columns(p, 1); break;
    case 2: columns(p, 2); break;
    case 4: columns(p, 4); break;
    default: columns(p, p->M); break;
    }
    return NULL;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* x: [M, K] bf16 (rows `x_stride` apart); codes [N, K] int8; scales [N, K / 32] fp32;
 * out [M, N] bf16 (rows `out_stride` apart). Returns 0, -1 for a shape it does not take
 * (M > 16, K not a multiple of 32), -2 when out of memory. `threads` splits the columns. */
int blink_q8_matmul(const uint16_t *x, int64_t x_stride, const int8_t *codes, const float *scales,
                    uint16_t *out, int64_t out_stride, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || M > MAX_ROWS || K % GROUP != 0) return -1;
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (xf == NULL) return -2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(x[m * x_stride + k]);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* a thread start costs ~20-50 us: one per ~1M weights at most */
    while (threads > 1 && N * K < ((int64_t)threads << 20)) threads--;
    pthread_t tid[MAX_THREADS];
    part_t part[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++)
        part[t] = (part_t){xf, codes, scales, out, M, K, out_stride, N * t / threads, N * (t + 1) / threads};
    for (int t = 1; t < threads; t++) running[t] = pthread_create(&tid[t], NULL, run_part, &part[t]) == 0;
    run_part(&part[0]);
    for (int t = 1; t < threads; t++) {
        if (running[t]) pthread_join(tid[t], NULL);
        else run_part(&part[t]);
    }
    free(xf);
    return 0;
}
