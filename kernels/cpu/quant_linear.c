/* y = x @ W.T (+ bias) for bf16 x and a weight kept as a GGUF file's own codes, on CPUs
 * without AMX: one source, built twice by kernels/cpu/quant_linear.py, once for AVX-512
 * (-march=x86-64-v4 -mavx512bf16: Intel Cooper Lake / Sapphire Rapids with AMX hidden, AMD
 * Zen 4 and 5) and once for AVX2 (-march=x86-64-v3: no AVX-512 instruction in that build);
 * the Python side loads the one the CPU's flags allow.
 *
 * Why: a decode step streams every projection weight once and does little arithmetic with
 * it, so its cost is the weight's bytes. The codes are ~4x fewer bytes than bf16 (8-bit
 * ones 2x). Without AMX torch's int4 kernel read them, with arithmetic that grows with the
 * rows, and only Q4_0/Q4_1; K-quants were dequantized to bf16 at load.
 *
 * Formats (`format` bits, kernels/cpu/quant_linear.py's pack): every weight is
 * w = d q + m per group of 32 (or 16: F_GROUP16) input channels of one output column, d and m
 * fp16 (a Q4_0/Q4_1/Q8_0 file's own) or fp32 (F_FP32: K-quants, whose d is the super-block's
 * fp16 d times a 6- or 8-bit sub-block scale, exact in fp32), m absent where it is 0 (no F_M).
 * Codes are 4-bit (0..15: Q4_0, Q4_1, Q4_K) or 8-bit (F_BITS8, int8: Q8_0, Q6_K as q - 32,
 * Q5_K as 0..31). Layout: the AMX kernel's (q4_linear.c): output columns in tiles of 16,
 * channels in groups of 32; a (tile, group) is 16 rows of 32 words, row p holding channels 2p
 * and 2p + 1 of the 16 columns interleaved (word w: column w / 2, channel 2p + w % 2); 4-bit
 * codes as 4 x 32 16-bit words whose nibble i is row 4c + i's, 8-bit as one byte per word.
 * Scales per (tile, scale group): 16 d, then (F_M) 16 m, one per column.
 *
 * Arithmetic: no weight is rounded, the product is on gguf's fp32 weights (up to fp32 sum
 * order), as the AMX kernel's few-rows path:
 * - AVX-512: per group x . q by vdpbf16ps with the codes as exact bf16 (one 4-bit code row
 *   per vpermw of a shifted word vector, as q4_linear.c), 32 products per instruction,
 *   then d (x . q) + m sum(x) in fp32. Up to 8 rows per pass share each unpacked row.
 * - AVX2: 8 columns at a time, x . q per group in fp32 FMAs on x's fp32 values and the codes
 *   as fp32 (exact), then d (x . q) + m sum(x).
 * Every row count takes the same code (decode steps and prefills alike), rows in passes of 8
 * (AVX2: 4) over a tile whose codes stay in L1, x's rows from L2 in panels of PANEL_ROWS. Each
 * row is summed in the same order whatever the rows beside it: its bits do not depend on the
 * step's batch (as the AMX kernel's few-rows path, which CPU decode graphs rely on when they
 * pad a step).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* rows per pass over a tile: AVX-512 (32 registers) and AVX2 (16) */
enum { TILE = 16, GROUP = 32, PAIRS = GROUP / 2, ROWS = 8, ROWS2 = 4 };
enum { F_BITS8 = 1, F_GROUP16 = 2, F_FP32 = 4, F_M = 8 };

/* Rows of x a tile's codes meet before the next tile's (x's panel stays in L2). */
enum { PANEL_ROWS = 128 };

/* How far ahead the codes are prefetched (as q4_linear.c). */
enum { PREFETCH_BYTES = 2048 };

typedef struct {
    const uint16_t *x;     /* [M, K] bf16, rows x_stride apart */
    int64_t x_stride;
    const uint8_t *codes;  /* [N / 16, K / 32, tile_bytes] */
    const uint8_t *scales; /* [N / 16, K / group, 1 or 2, 16] fp16 or fp32 */
    const uint16_t *bias;  /* [N] bf16 or NULL */
    uint16_t *y;           /* [M, N] bf16, rows y_stride apart */
    int64_t y_stride;
    int64_t M, N, K;
    int format;
    const float *x_sums;   /* [M, K / group]: each row's sum over each scale group (F_M) */
    const float *xf;       /* AVX2: [M, K] x in fp32 */
} args_t;

static inline int64_t tile_bytes(int format) { return format & F_BITS8 ? 512 : 256; }
static inline int64_t group_size(int format) { return format & F_GROUP16 ? 16 : 32; }
/* bytes of one scale group's d (and m) for one tile */
static inline int64_t scale_bytes(int format) {
    return (format & F_M ? 2 : 1) * TILE * (format & F_FP32 ? 4 : 2);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BLINK_QUANT_ISA 512

static inline __m512 load_scales16(const uint8_t *p, int fp32) {
    return fp32 ? _mm512_loadu_ps((const float *)p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512i pair_of(const uint16_t *x) { /* channels 2p, 2p + 1 in every 32-bit lane */
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Rows [r0, r0 + R) x tile t (16 columns), R <= ROWS known at compile time once inlined. */
static inline __attribute__((always_inline)) void tile_rows(const args_t *a, int64_t t, int64_t r0, const int R,
                                                            const int bits8, __m512i as_bf16) {
    const int format = a->format, fp32 = format & F_FP32, with_m = format & F_M, g16 = format & F_GROUP16;
    const int64_t groups = a->K / GROUP, tb = tile_bytes(format), sb = scale_bytes(format);
    const int64_t sgroups = a->K / group_size(format), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
    const uint8_t *scales = a->scales + t * sgroups * sb;
    const uint16_t *x = a->x + r0 * a->x_stride;
    const float *x_sums = with_m ? a->x_sums + r0 * sgroups : NULL;
    /* NACC running dots per row, pairs taking them in turn (a vdpbf16ps waits ~5 cycles for
     * the one before it on the same register), the same number whatever R: a row's sums, so
     * its bits, do not depend on the rows beside it in the step */
    enum { NACC = 2 };
    __m512 tot[ROWS], dot[ROWS][NACC];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        tot[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int j = 0; j < NACC; j++) dot[r][j] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * tb;
        if (bits8) {
            _mm_prefetch((const char *)gc + PREFETCH_BYTES + 256, _MM_HINT_T0);
            _mm_prefetch((const char *)gc + PREFETCH_BYTES + 320, _MM_HINT_T0);
            _mm_prefetch((const char *)gc + PREFETCH_BYTES + 384, _MM_HINT_T0);
            _mm_prefetch((const char *)gc + PREFETCH_BYTES + 448, _MM_HINT_T0);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2; /* all unrolled: p % NACC picks a register */
                _mm_prefetch((const char *)gc + c * 64 + PREFETCH_BYTES, _MM_HINT_T0);
                __m512i words = bits8 ? _mm512_setzero_si512() : _mm512_loadu_si512(gc + c * 64);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const int p = 4 * c + i;
                    __m512bh b;
                    if (bits8) {
                        const int8_t *row = (const int8_t *)gc + p * 2 * TILE;
                        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row)));
                        const __m512 hi = _mm512_cvtepi32_ps(
                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + TILE))));
                        b = _mm512_cvtne2ps_pbh(hi, lo); /* exact: |q| <= 128 */
                    } else {
                        /* vpermw reads an index's low 5 bits: as_bf16 holds bf16(i & 15) at i */
                        b = (__m512bh)_mm512_permutexvar_epi16(words, as_bf16);
                        words = _mm512_srli_epi16(words, 4);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        dot[r][p % NACC] = _mm512_dpbf16_ps(dot[r][p % NACC],
                                                            (__m512bh)pair_of(x + r * a->x_stride + g * GROUP + 2 * p), b);
                }
            }
            if (g16 || h == 1) { /* a scale group ends: tot += d (x . q) + m sum(x) */
                const int64_t s = g * per + (g16 ? h : 0);
                const __m512 d = load_scales16(scales + s * sb, fp32);
                if (with_m) {
                    const __m512 m = load_scales16(scales + s * sb + sb / 2, fp32);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[r * sgroups + s]), m, tot[r]);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    __m512 sum = dot[r][0];
                    dot[r][0] = _mm512_setzero_ps();
#pragma GCC unroll 4
                    for (int j = 1; j < NACC; j++) sum = _mm512_add_ps(sum, dot[r][j]), dot[r][j] = _mm512_setzero_ps();
                    tot[r] = _mm512_fmadd_ps(sum, d, tot[r]);
                }
            }
        }
    }
    const __m512 bias = a->bias ? load_bf16x16(a->bias + t * TILE) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) store_bf16x16(a->y + (r0 + r) * a->y_stride + t * TILE, _mm512_add_ps(tot[r], bias));
}

#define CASE(R)                                                                                   \
    case R:                                                                                       \
        if (bits8) tile_rows(a, t, r0, R, 1, as_bf16);                                            \
        else tile_rows(a, t, r0, R, 0, as_bf16);                                                  \
        break;

static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows, __m512i as_bf16) {
    const int bits8 = a->format & F_BITS8;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    }
}
#undef CASE

static void *run_tiles(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    uint16_t lut[32] __attribute__((aligned(64)));
    for (int i = 0; i < 32; i++) { /* bf16 of i & 15: the top half of the fp32's bits */
        const float f = (float)(i & 15);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        lut[i] = (uint16_t)(bits >> 16);
    }
    const __m512i as_bf16 = _mm512_load_si512(lut);
    for (int64_t p0 = 0; p0 < a->M; p0 += PANEL_ROWS) {
        const int64_t p1 = a->M - p0 < PANEL_ROWS ? a->M : p0 + PANEL_ROWS;
        for (int64_t t = p->lo; t < p->hi; t++)
            for (int64_t r0 = p0; r0 < p1; r0 += ROWS)
                tile_pass(a, t, r0, (int)(p1 - r0 < ROWS ? p1 - r0 : ROWS), as_bf16);
    }
    return NULL;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BLINK_QUANT_ISA 2

static inline __m256 load_scales8(const uint8_t *p, int fp32) {
    return fp32 ? _mm256_loadu_ps((const float *)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Rows [r0, r0 + R) x columns 8 hc .. 8 hc + 7 of tile t, R <= ROWS2 known at compile time. */
static inline __attribute__((always_inline)) void half_rows(const args_t *a, int64_t t, int hc, int64_t r0,
                                                            const int R, const int bits8) {
    const int format = a->format, fp32 = format & F_FP32, with_m = format & F_M, g16 = format & F_GROUP16;
    const int64_t groups = a->K / GROUP, tb = tile_bytes(format), sb = scale_bytes(format);
    const int64_t sgroups = a->K / group_size(format), per = g16 ? 2 : 1, esize = fp32 ? 4 : 2;
    const uint8_t *codes = a->codes + t * groups * tb;
    const uint8_t *scales = a->scales + t * sgroups * sb + hc * 8 * esize;
    const float *x = a->xf + r0 * a->K;
    const float *x_sums = with_m ? a->x_sums + r0 * sgroups : NULL;
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    /* Per scale group x . q in NACC running sums per row (an FMA waits ~4 cycles for the one
     * before it on the same register; channels take them in turn), then tot += d (x . q) + m
     * sum(x): the same order whatever R, so a row's bits do not depend on the rows beside it */
    enum { NACC = 2 };
    __m256 tot[ROWS2], dot[ROWS2][NACC];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        tot[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int j = 0; j < NACC; j++) dot[r][j] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * tb;
        if (hc == 0)
            for (int line = 0; line < tb; line += 64) _mm_prefetch((const char *)gc + line + PREFETCH_BYTES, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2;
                const __m256i words = bits8 ? _mm256_setzero_si256()
                                            : _mm256_loadu_si256((const __m256i *)(gc + c * 64 + hc * 32));
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const int p = 4 * c + i;
                    __m256i even, odd; /* each 32-bit lane: column j's codes at channels 2p, 2p + 1 */
                    if (bits8) {
                        const __m256i v = _mm256_cvtepi8_epi16(
                            _mm_loadu_si128((const __m128i *)(gc + p * 2 * TILE + hc * 16)));
                        even = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16);
                        odd = _mm256_srai_epi32(v, 16);
                    } else {
                        even = _mm256_and_si256(_mm256_srli_epi32(words, 4 * i), nibble);
                        odd = _mm256_and_si256(_mm256_srli_epi32(words, 16 + 4 * i), nibble);
                    }
                    const __m256 qe = _mm256_cvtepi32_ps(even), qo = _mm256_cvtepi32_ps(odd);
                    const float *xp = x + g * GROUP + 2 * p;
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) {
                        dot[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(xp + r * a->K), qe, dot[r][0]);
                        dot[r][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(xp + r * a->K + 1), qo, dot[r][1]);
                    }
                }
            }
            if (g16 || h == 1) { /* a scale group ends */
                const int64_t s = g * per + (g16 ? h : 0);
                const __m256 d = load_scales8(scales + s * sb, fp32);
                if (with_m) {
                    const __m256 m = load_scales8(scales + s * sb + sb / 2, fp32);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        tot[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x_sums + r * sgroups + s), m, tot[r]);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    tot[r] = _mm256_fmadd_ps(_mm256_add_ps(dot[r][0], dot[r][1]), d, tot[r]);
                    dot[r][0] = dot[r][1] = _mm256_setzero_ps();
                }
            }
        }
    }
    uint16_t *y = a->y + r0 * a->y_stride + t * TILE + hc * 8;
    float bias[8] = {0};
    if (a->bias)
        for (int j = 0; j < 8; j++) bias[j] = bf16_to_f32(a->bias[t * TILE + hc * 8 + j]);
    const __m256 b = _mm256_loadu_ps(bias);
    for (int r = 0; r < R; r++) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(tot[r], b));
        for (int j = 0; j < 8; j++) y[r * a->y_stride + j] = f32_to_bf16(out[j]);
    }
}

#define CASE(R)                                                                                   \
    case R:                                                                                       \
        if (bits8) half_rows(a, t, hc, r0, R, 1);                                                 \
        else half_rows(a, t, hc, r0, R, 0);                                                       \
        break;

static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows) {
    const int bits8 = a->format & F_BITS8;
    for (int hc = 0; hc < 2; hc++) switch (rows) {
            CASE(1) CASE(2) CASE(3) CASE(4)
        }
}
#undef CASE

static void *run_tiles(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    for (int64_t p0 = 0; p0 < a->M; p0 += PANEL_ROWS) {
        const int64_t p1 = a->M - p0 < PANEL_ROWS ? a->M : p0 + PANEL_ROWS;
        for (int64_t t = p->lo; t < p->hi; t++)
            for (int64_t r0 = p0; r0 < p1; r0 += ROWS2) tile_pass(a, t, r0, (int)(p1 - r0 < ROWS2 ? p1 - r0 : ROWS2));
    }
    return NULL;
}
#endif

/* Which instruction set this build uses: 512 (AVX-512 with BF16), 2 (AVX2), 0 (neither: the
 * Python side does not use it). */
int blink_quant_linear_isa(void) {
#ifdef BLINK_QUANT_ISA
    return BLINK_QUANT_ISA;
#else
    return 0;
#endif
}

#ifdef BLINK_QUANT_ISA
/* Each row's fp32 sum over each scale group (in channel order). */
static void group_sums(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t group, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < K / group; g++) {
            float s = 0.0f;
            for (int64_t c = 0; c < group; c++) s += bf16_to_f32(x[r * x_stride + g * group + c]);
            out[r * (K / group) + g] = s;
        }
}
#endif

/* Returns 0; -2 for shapes or formats this kernel does not take; -3 where this build has no
 * kernel; -4 out of memory. `threads` split the output tiles when the product is large enough
 * to pay for them. */
int blink_quant_linear(const uint16_t *x, int64_t x_stride, const void *codes, const void *scales,
                       const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                       int format, int threads) {
    if (M < 1 || N % TILE || K % GROUP || x_stride < K || y_stride < N || format < 0 || format > 15)
        return -2;
#ifndef BLINK_QUANT_ISA
    (void)x; (void)codes; (void)scales; (void)bias; (void)y; (void)threads;
    return -3;
#else
    float *x_sums = NULL, *xf = NULL;
    if (format & F_M) {
        x_sums = malloc((size_t)(M * (K / group_size(format))) * sizeof *x_sums);
        if (!x_sums) return -4;
        group_sums(x, x_stride, M, K, group_size(format), x_sums);
    }
#if BLINK_QUANT_ISA == 2
    xf = malloc((size_t)(M * K) * sizeof *xf);
    if (!xf) {
        free(x_sums);
        return -4;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < K; c++) xf[r * K + c] = bf16_to_f32(x[r * x_stride + c]);
#endif
    /* one thread per ~5-10 us of work at most: 64K weights per row pass */
    const int64_t passes = BLINK_QUANT_ISA == 2 ? (M + ROWS2 - 1) / ROWS2 : (M + ROWS - 1) / ROWS;
    threads = blink_threads_for(passes * N * K, (int64_t)1 << 16, threads);
    args_t a = {x, x_stride, (const uint8_t *)codes, (const uint8_t *)scales, bias, y, y_stride, M, N, K, format,
                x_sums, xf};
    const int status = blink_run_parts(run_tiles, &a, N / TILE, threads);
    free(x_sums);
    free(xf);
    return status;
#endif
}
