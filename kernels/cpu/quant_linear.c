/* y = x @ W.T (+ bias) for bf16 x and a weight kept as a GGUF file's own codes, on CPUs
 * without AMX: one source, built six times by kernels/cpu/quant_linear.py (VARIANTS): for
 * AVX-512 VNNI (int8 x), for AVX-512 BF16 (-march=x86-64-v4 -mavx512bf16: Intel Cooper Lake /
 * Sapphire Rapids with AMX hidden, AMD Zen 4 and 5), for AVX2 with AVX-VNNI and int8 x
 * (-march=x86-64-v3 -mavxvnni -DBLINK_QUANT_INT8_AVX2 -DBLINK_QUANT_AVX_VNNI), for AVX2 with
 * int8 x (-march=x86-64-v3 -DBLINK_QUANT_INT8_AVX2), for AVX2 (-march=x86-64-v3) and for Arm
 * with int8 x (-march=armv8.2-a+dotprod); no AVX2 build holds an AVX-512 instruction. The Python side
 * loads the first one the CPU's flags allow.
 *
 * Why: a decode step streams every projection weight once and does little arithmetic with
 * it, so its cost is the weight's bytes. The codes are ~4x fewer bytes than bf16 (8-bit
 * ones 2x). Without AMX torch's int4 kernel read them, with arithmetic that grows with the
 * rows, and only Q4_0/Q4_1; K-quants were dequantized to bf16 at load.
 *
 * Formats (`format` bits, kernels/cpu/quant_linear.py's pack): every weight is
 * w = d q + m per group of 32 (or 16: F_GROUP16) input channels of one output column, m absent
 * where it is 0 (no F_M), not stored where it is -8 d (F_M8 with F_M: Q4_0). Scales: fp16 d and m (a Q4_0/Q4_1/Q8_0 file's own), fp32 (F_FP32:
 * a K-quant whose k is not whole super-blocks: its d and m per group) or, for K-quants, the
 * file's own (F_K): per super-block of 256 channels an fp16 d (and dmin), per group an int8
 * scale sc (and min mn), d = d sc and m = -dmin mn formed here per group, exact in fp32 (11 x 8
 * significant bits): ~0.6 bits a weight, where fp32 d and m per group took 2.
 * Codes: 4-bit (0..15: Q4_0, Q4_1, Q4_K), 5-bit (F_BITS5: 0..31, Q5_K), 6-bit (F_BITS6: q + 32
 * for q in -32..31, Q6_K's q - 32) or 8-bit (F_BITS8, int8: Q8_0). A decode step reads what is
 * here, so these are (about) the file's bytes: Q4_K 4.625 bits a weight (the file 4.5), Q5_K
 * 5.625 (5.5), Q6_K 6.5625 (the file's).
 * Layout: the AMX kernel's (q4_linear.c): output columns in tiles of 16, channels in groups of
 * 32; a (tile, group) is 16 rows of 32 words, row p holding channels 2p and 2p + 1 of the 16
 * columns interleaved (word w: column w / 2, channel 2p + w % 2); 4-bit codes as 4 x 32 16-bit
 * words whose nibble i is row 4c + i's, 8-bit as one byte per word, 6-bit as the 4-bit layout
 * of the low nibbles then 2 x 32 16-bit words whose bits POS6[j], POS6[j] + 1 are row 8v + j's
 * top 2 bits (below), 5-bit as the 4-bit layout then 32 16-bit words whose bit p is row p's top bit.
 * Scales per (tile, scale group): 16 d, then (F_M) 16 m, one per column; F_K per (tile,
 * super-block): 16 fp16 d, (F_M) 16 fp16 -dmin, per group 16 int8 sc, then (F_M) per group 16
 * int8 mn.
 *
 * Arithmetic: no weight is rounded, the product is on gguf's fp32 weights (up to fp32 sum
 * order), as the AMX kernel's few-rows path:
 * - AVX-512: per group x . q by vdpbf16ps with the codes as exact bf16 (one 4-bit code row
 *   per vpermw of a shifted word vector, as q4_linear.c; a 6-bit one per vpternlogd joining
 *   the nibble and the top 2 bits and a vpermt2w; a 5-bit one the same with a vpermw), 32
 *   products per instruction,
 *   then d (x . q) + m sum(x) in fp32. Up to 8 rows per pass share each unpacked row.
 * - AVX2: 8 columns at a time, x . q per group in fp32 FMAs on x's fp32 values and the codes
 *   as fp32 (exact), then d (x . q) + m sum(x).
 * - The int8 builds (AVX-512 VNNI, AVX2 with -DBLINK_QUANT_INT8_AVX2 with or without AVX-VNNI, Arm) multiply x quantized to
 *   int8 per group of 32 (llama.cpp's Q8_0 activations; for K-quants on the file's scales per
 *   super-block of 256, its Q8_K) in exact integer sums: see their sections.
 * Every row count takes the same code (decode steps and prefills alike), rows in passes of 8
 * (AVX2, Arm: 4) over a tile whose codes stay in L1, x's rows from L2 in panels of PANEL_ROWS. Each
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
enum { F_BITS8 = 1, F_GROUP16 = 2, F_FP32 = 4, F_M = 8, F_BITS6 = 16, F_K = 32, F_BITS5 = 64, F_M8 = 128 };
/* channels per K-quant super-block */
enum { SUPER = 256 }; /* (a shift by 8 below) */

/* The 6-bit layout's 2-bit planes (quant_linear.py's POS6): row 8h + j's high 2 bits at bit
 * POS6[j] of each 16-bit word of plane h, so that byte b of the plane holds the high bits of
 * byte b of nibble vectors 2h (its low nibble's at bits 0-1, its high nibble's at 2-3) and
 * 2h + 1 (4-5, 6-7). */
static const int POS6[8] = {0, 2, 8, 10, 4, 6, 12, 14};

/* The int8 builds' one pass (a decode step) over a K-quant: its super-block's fp16 d and -dmin
 * converted once for the super-block's groups, not again for each (0: as before, the same bits;
 * the VNNI build's section says what it measured). */
#ifndef HOIST_SUPER_SCALES
#define HOIST_SUPER_SCALES 1
#endif

/* Rows of x a tile's codes meet before the next tile's (x's panel stays in L2). */
enum { PANEL_ROWS = 128 };

/* How far ahead the codes are prefetched: 6 KB. At 2 KB (q4_linear.c's distance) a one-row
 * pass read a 1B's Q6_K head at 0.67 of a plain read of the same bytes, waiting on memory. One
 * row, two threads, AMD Zen 5, 6 KB against 2 KB: the avx2_int8 and avx512 builds 1.04-1.24x,
 * the VNNI build's Q5_K, Q6_K and Q8_0 projections 1.02-1.21x and its Q4_K ones 0.95-1.19x by
 * the memory's speed, SmolLM2 and 16-128 rows level (docs/performance.md#prefetch-distance).
 * The Arm build takes the same distance, not measured on an Arm CPU either way. */
enum { PREFETCH_BYTES = 6144 };

/* The codes' prefetch: non-temporal on x86 (PREFETCHNTA). A step reads each code once, and with
 * the usual hint its stream pushed out of the caches what the step reads again (the activations,
 * the norms' weights, the KV cache, the host's work between the kernel calls). Decode steps on
 * AMD Zen 5, two threads, against _MM_HINT_T0: SmolLM2's 1.05-1.10x on the avx512_vnni,
 * avx2_int8 and avx512 builds (avx2 1.01x), the 1B's 1.05x on avx512_vnni (level on the others);
 * the products alone and 16-128 rows level (docs/performance.md#codes-prefetch-hint). Arm keeps
 * its usual hint (no Arm CPU measured). */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH_CODES(p) _mm_prefetch((const char *)(p), _MM_HINT_NTA)
#else
#define PREFETCH_CODES(p) __builtin_prefetch((p), 0, 3)
#endif

/* The int8 builds' one pass prefetches the scales' stream too (scales_ahead); a copy of this
 * source with 0 here is the version before it, for bench_quant_source --before. */
#ifndef PREFETCH_SCALES
#define PREFETCH_SCALES 1
#endif

/* The int8 builds' passes over a tile of several passes prefetch the next tile's codes into L2,
 * a share each (step bytes a group): the first pass alone would draw them from memory at the
 * rate its products go, the bandwidth's limit on two cores at 8+ rows, while the others draw
 * nothing (16 rows on a 1B's projections: 1.25x the time the weights take in L3). at: NULL
 * where there is none (one pass, the last tile). */
typedef struct { const uint8_t *at; int64_t step; } far_t;
static inline __attribute__((unused)) void prefetch_far(far_t far, int64_t g) {
    if (far.at)
        for (int64_t b = 0; b < far.step; b += 64) __builtin_prefetch(far.at + g * far.step + b, 0, 2); /* into L2 */
}

/* The int8 builds keep x's int8 codes, scales and per-scale-group sums in blocks of B rows (B:
 * the build's rows per pass, BLINK_QUANT_INT8_ROWS: VNNI 8, AVX2 4), group by group (row i of
 * block b, group g at ((b groups + g) B + i) GROUP for the codes, at (b groups + g) B + i for a
 * scale, (b sgroups + s) B + i for a sum): a pass (B rows from a multiple of B: the panels start
 * at multiples of PANEL_ROWS) reads each group's x at fixed offsets from one pointer, not at B
 * row addresses (the address arithmetic and its spilled registers were ~40% of the VNNI
 * build's instructions). */
static inline __attribute__((unused)) int64_t blocked(int64_t r, int64_t n, int64_t j, const int64_t B) {
    return ((r / B) * n + j) * B + r % B;
}

typedef struct {
    const uint16_t *x;     /* [M, K] bf16, rows x_stride apart */
    int64_t x_stride;
    const uint8_t *codes;  /* [N / 16, K / 32, tile_bytes] */
    const uint8_t *scales; /* [N / 16, K / group, 1 or 2, 16] fp16 or fp32; F_K: see k_scales */
    const uint16_t *bias;  /* [N] bf16 or NULL */
    uint16_t *y;           /* [M, N] bf16, rows y_stride apart */
    int64_t y_stride;
    int64_t M, N, K;
    int format;
    float *x_sums;         /* [M, K / group]: each row's sum over each scale group (F_M); int8
                            * builds: s sum(qx), blocked (F_K: sum(qx) alone, see k256) */
    const float *xf;       /* AVX2: [M, K] x in fp32 */
    int8_t *xq;            /* int8 builds: x's int8 codes, per group of 32 in the kernel's order, blocked */
    float *xs;             /* int8 builds: their scales, one per group of 32 (F_K: the super-block's,
                            * the same for its 8 groups), blocked */
    int32_t *xoff;         /* int8 builds: -off * sum(qx) per scale group, blocked */
} args_t;

static inline int64_t tile_bytes(int format) {
    return format & F_BITS8 ? 512 : format & F_BITS6 ? 384 : format & F_BITS5 ? 320 : 256;
}
static inline int64_t group_size(int format) { return format & F_GROUP16 ? 16 : 32; }
/* bytes of one scale group's d (and m) for one tile */
static inline int64_t scale_bytes(int format) {
    return (format & F_M && !(format & F_M8) ? 2 : 1) * TILE * (format & F_FP32 ? 4 : 2);
}
/* F_K: bytes of one (tile, super-block)'s scales: 16 fp16 d, (F_M) 16 fp16 -dmin, then per
 * scale group 16 int8 sc, then (F_M) per scale group 16 int8 mn */
static inline int64_t k_block_bytes(int format) {
    return (format & F_M ? 2 : 1) * (2 * TILE + (format & F_GROUP16 ? 16 : 8) * TILE); /* SUPER / group */
}
/* Where scale group s of tile t keeps its parts: F_K: d16 (the super-block's fp16 d), sc (int8),
 * and with F_M dm16 (fp16 -dmin), mn (int8); else d and m (fp16 or fp32) at *d16 / *dm16. */
typedef struct { const uint8_t *d16, *dm16; const int8_t *sc, *mn; } scale_at_t;
static inline scale_at_t scale_at(const args_t *a, int64_t t, int64_t s) {
    const int format = a->format;
    scale_at_t at = {0};
    if (format & F_K) { /* (shifts: a division per group would cost as much as its products) */
        const int log_nsub = format & F_GROUP16 ? 4 : 3;
        const int64_t nsub = (int64_t)1 << log_nsub, j = s & (nsub - 1);
        const uint8_t *block = a->scales + (t * (a->K >> 8) + (s >> log_nsub)) * k_block_bytes(format);
        at.d16 = block;
        if (format & F_M) {
            at.dm16 = block + 2 * TILE;
            at.sc = (const int8_t *)(block + 4 * TILE) + j * TILE;
            at.mn = (const int8_t *)(block + 4 * TILE) + (nsub + j) * TILE;
        } else {
            at.sc = (const int8_t *)(block + 2 * TILE) + j * TILE;
        }
    } else {
        const int64_t sb = scale_bytes(format);
        at.d16 = a->scales + (t * (a->K >> (format & F_GROUP16 ? 4 : 5)) + s) * sb;
        at.dm16 = at.d16 + sb / 2;
    }
    return at;
}

/* The int8 builds' one pass over tile t (a decode step, its scales formed inline): the tile's
 * scales are a second stream beside its codes, prefetched as many groups ahead as the codes (the
 * tiles' scales follow each other as their codes do): where group g's prefetch points (at + g
 * step). Left to the hardware, a one-row pass over a 1B's Q4_1 down_proj (64 bytes of scales a
 * 256 of codes) ran 1.04-1.08x slower, its gate/up 1.01-1.04x (docs/performance.md#scales-prefetch). */
static inline __attribute__((unused)) far_t scales_ahead(const args_t *a, int64_t t) {
    const int format = a->format;
    const int64_t ahead = PREFETCH_BYTES / tile_bytes(format);
    if (format & F_K) {
        const int64_t kb = k_block_bytes(format);
        return (far_t){a->scales + t * (a->K >> 8) * kb + ahead * (kb / (SUPER / GROUP)), kb / (SUPER / GROUP)};
    }
    const int64_t step = (GROUP / group_size(format)) * scale_bytes(format);
    return (far_t){a->scales + t * (a->K / GROUP) * step + ahead * step, step};
}

/* The int8 builds' sums of row r's int8 x over group g (s0, s1: channels 0-15 and 16-31 of
 * the group; the codes' order keeps those halves whole) per scale group (16 channels: each
 * half), in blocks of B rows (blocked): -off sum(qx) for the codes' offset off, and (F_M) the
 * min's s sum(qx), the sum of the rounded x, so that x's rounding errors meet the whole weight
 * d q + m, centred, as llama.cpp's Q8_1 sums do (m on the exact sum(x) measured 5-10x the
 * error a layer on SmolLM2); K-quants: sum(qx) alone, the super-block's scale applied after
 * its groups. */
static inline __attribute__((unused)) void store_x_sums(const args_t *a, int64_t r, int64_t g, int32_t s0, int32_t s1,
                                                        float amax, int off, const int64_t B) {
    const int format = a->format, with_m = (format & F_M) && !(format & F_M8);
    const int64_t sg = group_size(format), sgroups = a->K / sg;
    const float scale_back = format & F_K ? 1.0f : amax / 127.0f;
    if (sg == 16) {
        if (off) a->xoff[blocked(r, sgroups, 2 * g, B)] = -off * s0, a->xoff[blocked(r, sgroups, 2 * g + 1, B)] = -off * s1;
        if (with_m) a->x_sums[blocked(r, sgroups, 2 * g, B)] = scale_back * (float)s0,
                    a->x_sums[blocked(r, sgroups, 2 * g + 1, B)] = scale_back * (float)s1;
    } else {
        if (off) a->xoff[blocked(r, sgroups, g, B)] = -off * (s0 + s1);
        if (with_m) a->x_sums[blocked(r, sgroups, g, B)] = scale_back * (float)(s0 + s1);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__AVX512BF16__) || defined(__AVX512VNNI__))
#include <immintrin.h>
/* (both AVX-512 builds) */
static inline __m512 load_scales16(const uint8_t *p, int fp32) {
    return fp32 ? _mm512_loadu_ps((const float *)p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 int8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Scale group s of tile t: the 16 columns' d and (F_M) m in fp32; F_K: d = fp16 d * sc and
 * m = -dmin * mn, each exact in fp32 (11 x 8 significant bits) */
static inline void group_scales(const args_t *a, int64_t t, int64_t s, __m512 *d, __m512 *m) {
    const scale_at_t at = scale_at(a, t, s);
    if (a->format & F_K) {
        *d = _mm512_mul_ps(load_scales16(at.d16, 0), int8x16(at.sc));
        if (a->format & F_M) *m = _mm512_mul_ps(load_scales16(at.dm16, 0), int8x16(at.mn));
    } else {
        *d = load_scales16(at.d16, a->format & F_FP32);
        if (a->format & F_M8) *m = _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f)); /* exact */
        else if (a->format & F_M) *m = load_scales16(at.dm16, a->format & F_FP32);
    }
}

#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__AVX512BF16__) || defined(__AVX512VNNI__))) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* (both AVX2 builds) */
static inline __m256 load_scales8(const uint8_t *p, int fp32) {
    return fp32 ? _mm256_loadu_ps((const float *)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 int8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Rows [r0, r0 + R) of tile t's columns 8 hc .. 8 hc + 7 into y: tot[r] (+ bias) as bf16 */
static inline void store_rows8(const args_t *a, int64_t t, int hc, int64_t r0, int R, const __m256 *tot) {
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

/* Scale group s of tile t, columns 8 hc .. 8 hc + 7: d and (F_M) m in fp32 (as the AVX-512
 * builds' group_scales: the same values) */
static inline void group_scales(const args_t *a, int64_t t, int64_t s, int hc, __m256 *d, __m256 *m) {
    const scale_at_t at = scale_at(a, t, s);
    if (a->format & F_K) {
        *d = _mm256_mul_ps(load_scales8(at.d16 + hc * 16, 0), int8x8(at.sc + hc * 8));
        if (a->format & F_M) *m = _mm256_mul_ps(load_scales8(at.dm16 + hc * 16, 0), int8x8(at.mn + hc * 8));
    } else {
        const int64_t esize = a->format & F_FP32 ? 4 : 2;
        *d = load_scales8(at.d16 + hc * 8 * esize, a->format & F_FP32);
        if (a->format & F_M8) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f)); /* exact */
        else if (a->format & F_M) *m = load_scales8(at.dm16 + hc * 8 * esize, a->format & F_FP32);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BLINK_QUANT_ISA 8
/* The int8 build (AVX-512 VNNI: Intel Cascade Lake / Ice Lake and later, AMD Zen 4 and 5).
 *
 * Why: on a Sapphire Rapids core vdpbf16ps retires one every 2 cycles (123 GFLOPS a core,
 * measured), vpdpbusd two a cycle with twice the products each (~970 G int8 products and sums
 * a second): 8x. So here x is quantized as llama.cpp quantizes its activations (Q8_0: per
 * row and group of 32 channels, s = max|x| / 127, qx = round(x * (127 / max|x|)), ties to
 * even; for K-quants on the file's scales per super-block of 256, as its Q8_K: tile_rows'
 * k256) and each group's x . q is an exact int32 sum of the codes (as unsigned bytes u) times
 * qx. The weight w = d (u - off) + m is not rounded: off (Q4_0 8, Q6_K 32, Q8_0 128 after a
 * flip of the sign bit) comes off the int32 as off * sum(qx), and m multiplies s sum(qx), the
 * sum of the rounded x (not the exact sum(x): x's rounding errors must meet the whole,
 * centred weight, as in llama.cpp's Q8_1):
 *   y += (s * (sum(u qx) - off sum(qx))) * d + (s * sum(qx)) * m      per scale group, in fp32
 * (the int32 sum starts at -off sum(qx), a broadcast load: no instruction for it).
 * A row's bits do not depend on the rows beside it: its integer sums are exact in any order
 * and its fp32 ones run group after group whatever the pass.
 * Codes: the 4-bit layout's 64-byte vector c (rows 4c .. 4c + 3 of the tile, channels 8c ..
 * 8c + 7) gives, masked to its low nibbles, each column's channels 8c, 8c + 4, 8c + 1, 8c + 5
 * as the 4 bytes of its 32-bit lane, and shifted by 4 its channels 8c + 2, 8c + 6, 8c + 3,
 * 8c + 7: x's codes are stored in that order (PERM4), so a lane meets its 4 channels' x in one
 * broadcast 32-bit word. The 6-bit codes' high bits go to bits 4-5 of each byte with one
 * shift and one vpternlogd a vector (their planes' layout, POS6, was chosen for that: the
 * order before it took two shifts and two vpternlogd a vector, and Q6_K's one-row products
 * 1.23x the time from cache, 1.12-1.15x from memory, on Zen 4), the 5-bit ones' top bit with
 * two shifts and two vpternlogd; 8-bit rows 2k, 2k + 1 become each column's channels 4k ..
 * 4k + 3 with one vpermw (x in channel order). */
#define BLINK_QUANT_INT8 1
#define BLINK_QUANT_INT8_ROWS ROWS
#define BLINK_QUANT_INT8_ROW_CASES(U) CASE(1, U) CASE(2, U) CASE(3, U) CASE(4, U) CASE(5, U) CASE(6, U) CASE(7, U) CASE(8, U)
/* work per thread, in (passes x weights), at least: 64K products and sums a row pass, 40 KB of
 * 4-bit codes and scales, ~3-4 us of one core's reads from memory at a decode step's one row
 * (the weights come from memory there, not from cache). With 256K, SmolLM2's o_proj (576 x 576)
 * ran on one thread: 20.7 -> 13.6 us a call on two, cold (docs/performance.md#int8-split);
 * benchmarks/bench_forward.py --before int8-coarse-split builds the old value. */
#ifndef BLINK_QUANT_INT8_PER_THREAD
#define BLINK_QUANT_INT8_PER_THREAD ((int64_t)1 << 16)
#endif

/* tile_rows' in-place high nibbles and (both int8 builds) HOIST_SUPER_SCALES (0: shifted down
 * and converted per group, as before: the same bits; `benchmarks/bench_forward.py --before
 * int8-per-group-scales` builds both so). From L2 on a Xeon (1 thread, 1-2 rows) the nibbles
 * made SmolLM2's Q4_1 projections 1.01-1.03x and a 1B's Q4_K o_proj 1.03-1.04x faster, the
 * scales that o_proj 1.04-1.07x; from L3 or memory there, no change (the reads bound it). For
 * cores whose products bound a decode step (AMD Zen 4's AVX-512 runs in two halves): not
 * measured there. */
#ifndef HIGH_NIBBLE_IN_PLACE
#define HIGH_NIBBLE_IN_PLACE 1
#endif

/* channel of the group at position 8c + e of x's int8 codes: 4-bit layouts (5, 6 too) */
static const int PERM4[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* 4 of x's int8 codes read as one word (the vpdpbusd's broadcast operand in tile_rows) */
typedef int32_t __attribute__((may_alias)) x_word;

static inline __m512 load_bf16x16_i(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store_bf16x16_i(uint16_t *p, __m512 v) { /* as f32_to_bf16: nearest even, NaN quiet */
    const __m512i u = _mm512_castps_si512(v), top = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* a 16-bit shift by n (left) or -n (right): the 5/6-bit planes' bits to bit 4 of their bytes */
static inline __m512i shift16(__m512i h, const int n) {
    return n > 0 ? _mm512_slli_epi16(h, n) : n < 0 ? _mm512_srli_epi16(h, -n) : h;
}

/* off: what comes off each code before d (Q4_0 8, Q6_K 32, Q8_0 128), 0 where m holds the min */
static inline int code_offset(int format) {
    return format & F_BITS8 ? 128 : format & F_BITS6 ? 32 : format & F_M8 ? 8 : 0;
}

/* Vector c (rows 4c .. 4c + 3, channels 8c .. 8c + 7) of group g's codes `gc` as unsigned
 * bytes u: 4/5/6-bit codes' low nibbles (lo) and high nibbles shifted down (hi), the 5/6-bit
 * top bits in place; 8-bit codes' rows 2k, 2k + 1 interleaved, the sign bit flipped. Once per
 * pass over the tile (tile_rows), or once for all of a panel's passes (tile_unpack). */
static inline __attribute__((always_inline)) void unpack_vector(const uint8_t *gc, int c, const int bits,
                                                                __m512i *lo_out, __m512i *hi_out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i low_byte = _mm512_set1_epi16(0x00FF), top_mask = _mm512_set1_epi8(bits == 6 ? 0x30 : 0x10);
    /* 8-bit: out word 2j = row 2k's word j, 2j + 1 = row 2k + 1's (column j, channels 4k .. 4k + 3) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int h = c / 2, c2 = c % 2;
    __m512i lo, hi;
    if (bits == 8) {
        lo = _mm512_xor_si512(_mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(gc + c * 128)), flip);
        hi = _mm512_xor_si512(_mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(gc + c * 128 + 64)), flip);
    } else {
        const __m512i v = _mm512_loadu_si512(gc + c * 64);
        lo = _mm512_and_si512(v, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (bits == 6) {
            /* byte b of the plane holds the high bits of byte b of lo and hi (POS6): one
             * 16-bit shift puts each at bits 4-5 of its byte */
            const __m512i high6 = _mm512_loadu_si512(gc + 256 + h * 64);
            lo = _mm512_ternarylogic_epi32(lo, shift16(high6, 4 - 4 * c2), top_mask, 0xF8); /* lo | (top & mask) */
            hi = _mm512_ternarylogic_epi32(hi, shift16(high6, 2 - 4 * c2), top_mask, 0xF8);
        } else if (bits == 5) {
            /* lo's bytes are rows 4c (word's low byte) and 4c + 2 (high byte), hi's 4c + 1 and
             * 4c + 3; a row's top bit goes to bit 4 of its byte */
            const __m512i high5 = _mm512_loadu_si512(gc + 256);
            const int jb = 4 * c; /* row 4c's bit in high5 */
            const __m512i lo_top = _mm512_ternarylogic_epi32(shift16(high5, 4 - jb), shift16(high5, 12 - (jb + 2)),
                                                             low_byte, 0xE4);
            const __m512i hi_top = _mm512_ternarylogic_epi32(shift16(high5, 4 - (jb + 1)),
                                                             shift16(high5, 12 - (jb + 3)), low_byte, 0xE4);
            lo = _mm512_ternarylogic_epi32(lo, lo_top, top_mask, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, hi_top, top_mask, 0xF8);
        }
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* Whether a panel's passes read a tile's codes unpacked once (tile_unpack): every format here,
 * from 8 passes (64 rows). A 1B's Q4_K_M layer and Q6_K head, two threads (Xeon, 2026-12-06):
 * 1.10x at 64 rows, 1.14x at 128; at 2 passes 0.85x and at 4 0.98x (the unpacked tile's
 * stores, and twice the bytes each pass loads, cost what the unpacking saved). */
static inline int unpacks(int format) { (void)format; return 1; }
enum { UNPACK_MIN_PASSES = 8 };

/* bytes of one tile's unpacked codes (tile_unpack): per group and vector c, lo then hi */
static inline int64_t unpacked_bytes(int64_t K) { return K / GROUP * 4 * 2 * 64; }

/* Tile t's codes unpacked once for a panel's passes (tile_rows' `unpacked`): the unpacking (3
 * instructions a vector for 4-bit codes, 7 for 6-bit, 4 for 8-bit) is then not redone by
 * every pass of ROWS rows, which read two vectors instead. */
static void tile_unpack(const args_t *a, int64_t t, uint8_t *out) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int bits = a->format & F_BITS8 ? 8 : a->format & F_BITS6 ? 6 : a->format & F_BITS5 ? 5 : 4;
    const uint8_t *codes = a->codes + t * groups * tb;
    for (int64_t g = 0; g < groups; g++)
        for (int c = 0; c < 4; c++) {
            __m512i lo, hi;
            if (bits == 8) unpack_vector(codes + g * tb, c, 8, &lo, &hi);
            else if (bits == 6) unpack_vector(codes + g * tb, c, 6, &lo, &hi);
            else if (bits == 5) unpack_vector(codes + g * tb, c, 5, &lo, &hi);
            else unpack_vector(codes + g * tb, c, 4, &lo, &hi);
            uint8_t *at = out + (g * 4 + c) * 128;
            _mm512_store_si512(at, lo);
            _mm512_store_si512(at + 64, hi);
        }
}

/* Rows [r0, r0 + R) x tile t (16 columns); r0 a multiple of ROWS. R <= ROWS, the code width,
 * whether m is stored, the codes' offset, 16-channel scale groups and k256 are known at compile
 * time once inlined (tile_pass' kinds), so the loop holds no test of the format.
 * k256 (F_K: x's scale s per super-block of 256 channels, llama.cpp's Q8_K for K-quants): a
 * super-block's groups add sum(u qx) d + sum(qx) m in units of s, times s once at its end, so a
 * group's fp32 work per row is a convert and two FMAs instead of a convert, a multiply by its
 * own s and two FMAs (1.10-1.15x at 16-128 rows on Zen 4, where that work was ~1/3 of the
 * instructions; x's rounding per 256: performance.md#int8-accuracy). */
static inline __attribute__((always_inline)) void tile_rows(const args_t *a, int64_t t, int64_t r0, const int R,
                                                            const int bits, const int with_m, const int off,
                                                            const int g16, const int k256, const float *scales,
                                                            far_t far, const uint8_t *unpacked) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int64_t sgroups = a->K / (g16 ? 16 : GROUP), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
    const int8_t *xq = a->xq + blocked(r0, groups, 0, ROWS) * GROUP; /* group g, row r: xq + (g ROWS + r) GROUP */
    const float *xs = a->xs + blocked(r0, groups, 0, ROWS);          /* xs[g ROWS + r] */
    const int32_t *xoff = a->xoff + blocked(r0, sgroups, 0, ROWS);   /* -off sum(qx): xoff[s ROWS + r] */
    const float *x_sums = a->x_sums + blocked(r0, sgroups, 0, ROWS); /* s sum(qx): x_sums[s ROWS + r] */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* integer sums are exact in any order: two per row where few rows leave the adds waiting */
    enum { NACC = 2 };
    const int nacc = R > 4 ? 1 : NACC;
    /* With two sums a row, 4-bit codes' high nibbles stay in place: v & 0xF0 is 16 q, its
     * products (at most 240 x 127) go to the second sum, which is then 16x its share exactly
     * and is shifted back once per scale group: one instruction a code vector fewer (no
     * shift) for one a group, the same integer sums (so the same bits at any rows). */
    const int in_place = HIGH_NIBBLE_IN_PLACE && bits == 4 && nacc == 2 && !unpacked;
    __m512i acc[ROWS][NACC];
    __m512 tot[ROWS], block[ROWS]; /* block: k256's sum over the super-block so far, in units of x's scale */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        tot[r] = _mm512_setzero_ps();
        block[r] = _mm512_setzero_ps();
        acc[r][0] = off ? _mm512_set1_epi32(xoff[r]) : _mm512_setzero_si512();
        acc[r][1] = _mm512_setzero_si512();
    }
    /* one pass, k256: the super-block's fp16 d and -dmin in fp32, converted once for its 8
     * groups (d = d sc and m = -dmin mn as group_scales forms them: the same bits) */
    const int64_t k_bytes = k_block_bytes(a->format), nsub = g16 ? 16 : 8;
    const uint8_t *super_at = NULL;
    __m512 super_d = _mm512_setzero_ps(), super_m = _mm512_setzero_ps();
    const far_t scales_far = scales_ahead(a, t);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * tb;
        for (int line = 0; line < tb; line += 64) PREFETCH_CODES(gc + line + PREFETCH_BYTES);
        if (PREFETCH_SCALES && !scales) PREFETCH_CODES(scales_far.at + g * scales_far.step);
        prefetch_far(far, g);
        const int8_t *xg = xq + g * ROWS * GROUP;
        if (HOIST_SUPER_SCALES && k256 && !scales && (g & 7) == 0) { /* a super-block starts (SUPER / GROUP groups) */
            super_at = a->scales + (t * (a->K >> 8) + (g >> 3)) * k_bytes;
            super_d = load_scales16(super_at, 0);
            if (with_m) super_m = load_scales16(super_at + 2 * TILE, 0);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* channels 16h .. 16h + 15 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2;
                __m512i lo, hi;
                if (unpacked) { /* tile_unpack's, for every pass of the panel */
                    const uint8_t *at = unpacked + (g * 4 + c) * 128;
                    lo = _mm512_load_si512(at);
                    hi = _mm512_load_si512(at + 64);
                } else if (in_place) { /* v & 0xF0: the high nibble in place (16 q) */
                    const __m512i v = _mm512_loadu_si512(gc + c * 64);
                    lo = _mm512_and_si512(v, low4);
                    hi = _mm512_andnot_si512(low4, v);
                } else {
                    unpack_vector(gc, c, bits, &lo, &hi);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    /* x's 4 codes broadcast by the vpdpbusd itself ({1to16}): from the intrinsics
                     * GCC emits a vpbroadcastd before each one, as many instructions again as
                     * the products (the embedded broadcast measured 1.06-1.09x at 16-128 rows on
                     * Zen 4, the same bits) */
                    const x_word *w = (const x_word *)(const void *)(xg + r * GROUP + 8 * c);
                    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[r][0]) : "v"(lo), "m"(w[0]));
                    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[r][nacc - 1]) : "v"(hi), "m"(w[1]));
                }
            }
            if (g16 || h == 1) { /* a scale group ends */
                const int64_t s = g * per + (g16 ? h : 0);
                /* the next scale group's sums start at its -off sum(qx) (the last group's start,
                 * read again after the last, is not used) */
                const int64_t s_next = s + 1 < sgroups ? s + 1 : s;
                __m512 d, m = _mm512_setzero_ps();
                if (scales) { /* formed once for the tile's passes */
                    d = _mm512_load_ps(scales + s * 2 * TILE);
                    if (with_m) m = _mm512_load_ps(scales + s * 2 * TILE + TILE);
                } else if (HOIST_SUPER_SCALES && k256) { /* one pass: sc and mn of this group */
                    const int8_t *sc = (const int8_t *)(super_at + (with_m ? 4 : 2) * TILE) + (s & (nsub - 1)) * TILE;
                    d = _mm512_mul_ps(super_d, int8x16(sc));
                    if (with_m) m = _mm512_mul_ps(super_m, int8x16(sc + nsub * TILE));
                } else { /* one pass (a decode step): formed here, no extra trip over them */
                    group_scales(a, t, s, &d, &m);
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const __m512i sum = nacc == 1 ? acc[r][0]
                                        : _mm512_add_epi32(acc[r][0], in_place ? _mm512_srai_epi32(acc[r][1], 4) : acc[r][1]);
                    if (k256) { /* x's scale is the super-block's: applied once at its end */
                        block[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, block[r]);
                        if (with_m) block[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[s * ROWS + r]), m, block[r]);
                    } else {
                        const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs[g * ROWS + r]));
                        tot[r] = _mm512_fmadd_ps(part, d, tot[r]);
                        if (with_m) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[s * ROWS + r]), m, tot[r]);
                    }
                    acc[r][0] = off ? _mm512_set1_epi32(xoff[s_next * ROWS + r]) : _mm512_setzero_si512();
                    acc[r][1] = _mm512_setzero_si512();
                }
            }
        }
        if (k256 && (g & 7) == 7) { /* a super-block ends */
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                tot[r] = _mm512_fmadd_ps(block[r], _mm512_set1_ps(xs[g * ROWS + r]), tot[r]);
                block[r] = _mm512_setzero_ps();
            }
        }
    }
    const __m512 bias = a->bias ? load_bf16x16_i(a->bias + t * TILE) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) store_bf16x16_i(a->y + (r0 + r) * a->y_stride + t * TILE, _mm512_add_ps(tot[r], bias));
}


/* A tile's d and m in fp32 for every scale group, 16 each (the rows' passes read them, formed once) */
static void tile_scales(const args_t *a, int64_t t, float *out) {
    const int64_t sgroups = a->K / group_size(a->format);
    for (int64_t s = 0; s < sgroups; s++) {
        __m512 d, m = _mm512_setzero_ps();
        group_scales(a, t, s, &d, &m);
        _mm512_store_ps(out + s * 2 * TILE, d);
        _mm512_store_ps(out + s * 2 * TILE + TILE, m);
    }
}

/* Rows [lo, hi) of x -> their int8 codes (PERM4 order but for 8-bit codes), scales, -off *
 * sum(qx) and (F_M) s sum(qx) per scale group. */
static void *quantize_rows(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    const int format = a->format, off = code_offset(format), k256 = !!(format & F_K);
    const int64_t groups = a->K / GROUP;
    int perm[GROUP];
    for (int i = 0; i < GROUP; i++) perm[i] = format & F_BITS8 ? i : (i & ~7) + PERM4[i & 7];
    const __m512i idx_lo = _mm512_loadu_si512(perm), idx_hi = _mm512_loadu_si512(perm + 16);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = p->lo; r < p->hi; r++) {
        const uint16_t *x = a->x + r * a->x_stride;
        int8_t *q = a->xq + blocked(r, groups, 0, ROWS) * GROUP; /* group g at q + g ROWS GROUP */
        float amax = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 v0 = load_bf16x16_i(x + g * GROUP), v1 = load_bf16x16_i(x + g * GROUP + 16);
            if (!k256 || (g & 7) == 0) { /* per group, or (K-quants) per super-block of 8 groups */
                __m512 top = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
                for (int64_t e = 1; e < (k256 ? 8 : 1); e++)
                    top = _mm512_max_ps(top, _mm512_max_ps(_mm512_andnot_ps(sign, load_bf16x16_i(x + (g + e) * GROUP)),
                                                           _mm512_andnot_ps(sign, load_bf16x16_i(x + (g + e) * GROUP + 16))));
                amax = _mm512_reduce_max_ps(top);
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            a->xs[blocked(r, groups, g, ROWS)] = amax / 127.0f;
            const __m512 scale = _mm512_set1_ps(inv);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(v0, idx_lo, v1), scale));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(v0, idx_hi, v1), scale));
            _mm_storeu_si128((__m128i *)(q + g * ROWS * GROUP), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + g * ROWS * GROUP + 16), _mm512_cvtepi32_epi8(q1));
            store_x_sums(a, r, g, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1), amax, off, ROWS);
        }
    }
    return NULL;
}

#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BLINK_QUANT_ISA 512

/* bf16 code tables: 4-bit (vpermw, i & 15 at i), 6-bit (vpermt2w, i - 32 at i over two
 * registers), and the mask of a word's low nibble */
typedef struct { __m512i as_bf16, six_lo, six_hi, nibble, five; } luts_t;

static inline __m512i pair_of(const uint16_t *x) { /* channels 2p, 2p + 1 in every 32-bit lane */
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Rows [r0, r0 + R) x tile t (16 columns), R <= ROWS known at compile time once inlined. */
static inline __attribute__((always_inline)) void tile_rows(const args_t *a, int64_t t, int64_t r0, const int R,
                                                            const int bits, const luts_t *lut) {
    const int format = a->format, with_m = format & F_M, g16 = format & F_GROUP16, bits8 = bits == 8;
    const int64_t groups = a->K / GROUP, tb = tile_bytes(format);
    const int64_t sgroups = a->K / group_size(format), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
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
        if (bits != 4) PREFETCH_CODES(gc + PREFETCH_BYTES + 256);
        if (bits > 5) PREFETCH_CODES(gc + PREFETCH_BYTES + 320);
        if (bits8) {
            PREFETCH_CODES(gc + PREFETCH_BYTES + 384);
            PREFETCH_CODES(gc + PREFETCH_BYTES + 448);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2; /* all unrolled: p % NACC picks a register */
                PREFETCH_CODES(gc + c * 64 + PREFETCH_BYTES);
                __m512i words = bits8 ? _mm512_setzero_si512() : _mm512_loadu_si512(gc + c * 64);
                /* 6-bit: the 2-bit plane, rows 8h .. 8h + 7 at bits POS6[p % 8] of each word */
                /* 5-bit: the 1-bit plane, row p's at bit p of each word */
                const __m512i high = bits == 6 ? _mm512_loadu_si512(gc + 256 + h * 64)
                                     : bits == 5 ? _mm512_loadu_si512(gc + 256) : _mm512_setzero_si512();
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
                    } else if (bits == 6) {
                        /* index = the nibble | the row's 2 high bits at bits 4..5 (one vpternlogd:
                         * nibble mask ? words : high); vpermt2w reads its low 6 bits: bf16(i - 32) */
                        const int up = 4 - POS6[4 * c2 + i];
                        const __m512i hs = up > 0 ? _mm512_slli_epi16(high, up) : _mm512_srli_epi16(high, -up);
                        const __m512i index = _mm512_ternarylogic_epi32(words, hs, lut->nibble, 0xE4);
                        b = (__m512bh)_mm512_permutex2var_epi16(lut->six_lo, index, lut->six_hi);
                        words = _mm512_srli_epi16(words, 4);
                    } else if (bits == 5) { /* the nibble | the row's top bit at bit 4; vpermw: bf16(i) */
                        const int up = 4 - p;
                        const __m512i hs = up > 0 ? _mm512_slli_epi16(high, up) : _mm512_srli_epi16(high, -up);
                        const __m512i index = _mm512_ternarylogic_epi32(words, hs, lut->nibble, 0xE4);
                        b = (__m512bh)_mm512_permutexvar_epi16(index, lut->five);
                        words = _mm512_srli_epi16(words, 4);
                    } else {
                        /* vpermw reads an index's low 5 bits: as_bf16 holds bf16(i & 15) at i */
                        b = (__m512bh)_mm512_permutexvar_epi16(words, lut->as_bf16);
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
                __m512 d, m = _mm512_setzero_ps();
                group_scales(a, t, s, &d, &m);
                if (with_m) {
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
        if (a->format & F_BITS8) tile_rows(a, t, r0, R, 8, lut);                                  \
        else if (a->format & F_BITS6) tile_rows(a, t, r0, R, 6, lut);                             \
        else if (a->format & F_BITS5) tile_rows(a, t, r0, R, 5, lut);                             \
        else tile_rows(a, t, r0, R, 4, lut);                                                      \
        break;

static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows, const luts_t *lut) {
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    }
}
#undef CASE

static void *run_tiles(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    uint16_t four[32] __attribute__((aligned(64))), five[32] __attribute__((aligned(64))),
        six[64] __attribute__((aligned(64)));
    for (int i = 0; i < 64; i++) { /* bf16 of i & 15, i and i - 32: the top half of the fp32's bits */
        const float f4 = (float)(i & 15), f5 = (float)i, f6 = (float)(i - 32);
        uint32_t b4, b5, b6;
        memcpy(&b4, &f4, sizeof b4);
        memcpy(&b5, &f5, sizeof b5);
        memcpy(&b6, &f6, sizeof b6);
        if (i < 32) four[i] = (uint16_t)(b4 >> 16), five[i] = (uint16_t)(b5 >> 16);
        six[i] = (uint16_t)(b6 >> 16);
    }
    const luts_t luts = {_mm512_load_si512(four), _mm512_load_si512(six), _mm512_load_si512(six + 32),
                         _mm512_set1_epi32(0x000F000F), _mm512_load_si512(five)};
    const luts_t *lut = &luts;
    for (int64_t p0 = 0; p0 < a->M; p0 += PANEL_ROWS) {
        const int64_t p1 = a->M - p0 < PANEL_ROWS ? a->M : p0 + PANEL_ROWS;
        for (int64_t t = p->lo; t < p->hi; t++)
            for (int64_t r0 = p0; r0 < p1; r0 += ROWS)
                tile_pass(a, t, r0, (int)(p1 - r0 < ROWS ? p1 - r0 : ROWS), lut);
    }
    return NULL;
}

#elif defined(BLINK_QUANT_INT8_AVX2) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if defined(BLINK_QUANT_AVX_VNNI) && defined(__AVXVNNI__)
/* With AVX-VNNI (-mavxvnni -DBLINK_QUANT_AVX_VNNI: Intel Alder Lake and later client cores,
 * Xeon 6 E-cores (Sierra Forest), AMD Zen 5; the 256-bit VEX vpdpbusd, no AVX-512): each
 * vpmaddubsw + vpaddw (+ a share of vpmaddwd) becomes one vpdpbusd, which sums the 4 byte
 * products of a lane straight into int32 without saturating; 8-bit codes keep the sign trick
 * (|q| <= 128 as unsigned bytes). The integer sums are exact either way: this build gives the
 * other int8 builds' bits. */
#define BLINK_QUANT_ISA 29
#define AVX_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define BLINK_QUANT_ISA 28
#define AVX_VNNI 0
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { (void)u; (void)s; return acc; } /* (not reached) */
#endif
/* The AVX2 int8 build (x86-64-v3 with -DBLINK_QUANT_INT8_AVX2: no AVX-512 instruction; for
 * CPUs with AVX2 but without AVX-512, Intel Haswell to Comet Lake, AMD Zen 1 to 3; with
 * -mavxvnni -DBLINK_QUANT_AVX_VNNI the AVX-VNNI build above, for Alder Lake and later).
 *
 * Why: the AVX2 build's fp32 FMAs multiply 8 products an instruction, so its cost grows fast
 * with the rows (it takes steps of few rows; a bf16 copy the others, which such a CPU
 * multiplies without native bf16). vpmaddubsw multiplies 32 unsigned x signed byte pairs an
 * instruction, summing neighbours into int16, and vpmaddwd with ones sums those into int32
 * (llama.cpp's AVX2 dot products). So x is quantized as in the VNNI build (the same values:
 * quantize_activations) and each group's x . q is an exact integer sum, then the same
 * epilogue in the same fp32 order:
 *   y += (s * (sum(u qx) - off sum(qx))) * d + (s * sum(qx)) * m      per scale group
 * (the same values and roundings as the VNNI build: the two give the same bits).
 * Exactness: vpmaddubsw saturates a pair's sum at int16, so the products stay within it: a
 * pair of u qx is at most 2 * 15 * 127 = 3810 (4-bit), 7874 (5-bit), 16002 (6-bit, u <= 63),
 * and pairs are summed in int16 (vpaddw) for 8, 4 and 2 of them (a scale group of 4-bit
 * codes, 32 or 16 channels of 5-bit ones, 8 channels of 6-bit ones) before vpmaddwd widens
 * them, never past 32767. 8-bit codes (Q8_0, q in -128..127) as u = q + 128 would
 * saturate (255 * 127 * 2): they take llama.cpp's sign trick instead, vpmaddubsw(|q|,
 * sign(qx, q)) = q qx with |q| <= 128 (a pair at most 32512), no offset, each widened alone.
 * Codes: as the VNNI build, 8 columns a register (columns 8 hc .. 8 hc + 7 of a tile, both
 * halves side by side in a pass): the 4-bit layout's vector c masked to its low nibbles gives each
 * column's channels 8c, 8c + 4, 8c + 1, 8c + 5 in its 32-bit lane, shifted by 4 its 8c + 2,
 * 8c + 6, 8c + 3, 8c + 7 (x's codes in PERM4 order: one broadcast word a lane); 5/6-bit top
 * bits shifted and masked into bits 4 (and 5) of each byte; 8-bit rows 2k, 2k + 1
 * interleaved by vpermq + vpshufb into each column's channels 4k .. 4k + 3 (x in channel
 * order). A row's bits do not depend on the rows beside it: its integer sums are exact in
 * any order and its fp32 ones run group after group whatever the pass.
 * x's codes, scales and sums: in blocks of ROWS_I8 rows, group by group (blocked), so a pass
 * reads each group's x at fixed offsets from one pointer; a loop per format kind (KINDS). */
#define BLINK_QUANT_INT8 1

/* rows per pass over a tile's half, and x's block (blocked): 4 (a row holds its fp32 total,
 * int32 and int16 sums) */
enum { ROWS_I8 = 4 };
#define BLINK_QUANT_INT8_ROWS ROWS_I8
#define BLINK_QUANT_INT8_ROW_CASES(U) CASE(1, U) CASE(2, U) CASE(3, U) CASE(4, U)
/* work per thread, in (passes x weights): a pass of 4 rows here costs about what the VNNI
 * build's of 8 did at 2^18 (its value before small projections split at 2^16 there; a
 * one-row pass over SmolLM2's o_proj already splits here: not measured on a CPU without
 * AVX-512 since) */
#define BLINK_QUANT_INT8_PER_THREAD ((int64_t)1 << 17)

/* channel of the group at position 8c + e of x's int8 codes: 4-bit layouts (5, 6 too) */
static const int PERM4[8] = {0, 4, 1, 5, 2, 6, 3, 7};

static inline __m256 load_bf16x8_i(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline int32_t sum8_epi32(__m256i v) {
    const __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    return _mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 1);
}

static inline __m256i shift16(__m256i h, const int n) {
    return n > 0 ? _mm256_slli_epi16(h, n) : n < 0 ? _mm256_srli_epi16(h, -n) : h;
}

/* 4 bytes of x's codes in every 32-bit lane: one vbroadcastss from memory (through memcpy and
 * a scalar, GCC copied them to the stack first) */
static inline __m256i broadcast4(const int8_t *p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)p));
}

/* off: what comes off each code before d (Q4_0 8, Q6_K 32), 0 where m holds the min and for
 * 8-bit codes (signed here: the sign trick) */
static inline int code_offset(int format) {
    return format & F_BITS8 ? 0 : format & F_BITS6 ? 32 : format & F_M8 ? 8 : 0;
}

/* Vector c (rows 4c .. 4c + 3) of group g's codes `gc` for columns 8 hc .. 8 hc + 7, 4/5/6-bit
 * codes: each column's channels 8c, 8c + 4, 8c + 1, 8c + 5 (lo) and 8c + 2, 8c + 6, 8c + 3,
 * 8c + 7 (hi) as unsigned bytes u in its 32-bit lane, the 5/6-bit top bits in place. Once per
 * pass over the tile (tile_rows), or once for all of a panel's passes (tile_unpack). */
static inline __attribute__((always_inline)) void unpack_vector(const uint8_t *gc, int hc, int c, const int bits,
                                                                __m256i *lo_out, __m256i *hi_out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i top_lo = _mm256_set1_epi16(0x0010), top_hi = _mm256_set1_epi16(0x1000); /* 5-bit */
    const __m256i top_both = _mm256_set1_epi8(0x30);                                       /* 6-bit */
    const int h = c / 2, c2 = c % 2;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(gc + c * 64 + hc * 32));
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (bits == 6) { /* as the VNNI build's: one shift a vector (POS6) */
        const __m256i high6 = _mm256_loadu_si256((const __m256i *)(gc + 256 + h * 64 + hc * 32));
        lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(high6, 4 - 4 * c2), top_both));
        hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(high6, 2 - 4 * c2), top_both));
    } else if (bits == 5) {
        /* lo's bytes are rows 4c (word's low byte) and 4c + 2 (high byte), hi's 4c + 1 and
         * 4c + 3; a row's top bit goes to bit 4 of its byte */
        const __m256i high5 = _mm256_loadu_si256((const __m256i *)(gc + 256 + hc * 32));
        const int jb = 4 * c; /* row 4c's bit in high5 */
        lo = _mm256_or_si256(lo, _mm256_or_si256(_mm256_and_si256(shift16(high5, 4 - jb), top_lo),
                                                 _mm256_and_si256(shift16(high5, 12 - (jb + 2)), top_hi)));
        hi = _mm256_or_si256(hi, _mm256_or_si256(_mm256_and_si256(shift16(high5, 4 - (jb + 1)), top_lo),
                                                 _mm256_and_si256(shift16(high5, 12 - (jb + 3)), top_hi)));
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* Whether a panel's passes read a tile's codes unpacked once (tile_unpack): 4/5/6-bit ones (the
 * 8-bit ones' interleave is two instructions a vector, and their sign trick reads lo and hi) */
static inline int unpacks(int format) { return !(format & F_BITS8); }
/* from 4 passes (16 rows): the same 1B products, two threads, 1.10x at 16 rows, 1.21-1.25x at
 * 64-128 (AVX2 code on the Xeon, 2026-12-06) */
enum { UNPACK_MIN_PASSES = 4 };

/* bytes of one tile's unpacked codes (tile_unpack): per group, half and vector c, lo then hi */
static inline int64_t unpacked_bytes(int64_t K) { return K / GROUP * 2 * 4 * 2 * 32; }

/* Tile t's 4/5/6-bit codes unpacked once for a panel's passes (tile_rows' `unpacked`): the
 * unpacking (3 instructions a vector for 4-bit codes, 9 for 6-bit) is then not redone by
 * every pass of ROWS_I8 rows, which read two vectors instead. */
static void tile_unpack(const args_t *a, int64_t t, uint8_t *out) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int bits = a->format & F_BITS6 ? 6 : a->format & F_BITS5 ? 5 : 4;
    const uint8_t *codes = a->codes + t * groups * tb;
    for (int64_t g = 0; g < groups; g++)
        for (int hc = 0; hc < 2; hc++)
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                if (bits == 6) unpack_vector(codes + g * tb, hc, c, 6, &lo, &hi);
                else if (bits == 5) unpack_vector(codes + g * tb, hc, c, 5, &lo, &hi);
                else unpack_vector(codes + g * tb, hc, c, 4, &lo, &hi);
                uint8_t *at = out + ((g * 2 + hc) * 4 + c) * 64;
                _mm256_store_si256((__m256i *)at, lo);
                _mm256_store_si256((__m256i *)(at + 32), hi);
            }
}

/* Rows [r0, r0 + R) x the 16 columns of tile t, as two halves of 8 (AVX2's 8 int32 lanes:
 * columns 8 hc .. 8 hc + 7) in one pass over the tile's groups, which share each group's x
 * broadcasts, the loop and the prefetches (a pass per half, as before, was 1.34-1.41x slower
 * at 1-4 rows, 1.06x at 8 and 1.12-1.14x at 16-128: benchmarks/bench_quant_source --build
 * avx2_int8, AMD Zen 4 capped to AVX2, docs/performance.md#avx2-zen4); r0 a multiple of ROWS_I8 (x in blocks of ROWS_I8 rows:
 * blocked). R <= ROWS_I8, the code width, whether m is stored, the codes' offset and g16
 * (scale groups of 16) are known at compile time once inlined (tile_pass' kinds), so the loop
 * holds no test of the format; scales: the tile's fp32 d and m per scale group (tile_scales),
 * NULL: formed here. */
static inline __attribute__((always_inline)) void tile_rows(const args_t *a, int64_t t, int64_t r0,
                                                            const int R, const int bits, const int with_m,
                                                            const int off, const int g16, const int k256,
                                                            const float *scales, far_t far,
                                                            const uint8_t *unpacked) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int64_t sgroups = a->K / (g16 ? 16 : GROUP), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
    const int8_t *xq = a->xq + blocked(r0, groups, 0, ROWS_I8) * GROUP; /* group g, row r: xq + (g ROWS_I8 + r) GROUP */
    const float *xs = a->xs + blocked(r0, groups, 0, ROWS_I8);          /* xs[g ROWS_I8 + r] */
    const int32_t *xoff = a->xoff + blocked(r0, sgroups, 0, ROWS_I8);   /* -off sum(qx): xoff[s ROWS_I8 + r] */
    const float *x_sums = a->x_sums + blocked(r0, sgroups, 0, ROWS_I8); /* s sum(qx): x_sums[s ROWS_I8 + r] */
    const __m256i ones = _mm256_set1_epi16(1);
    /* 8-bit: in each 128-bit lane, words 0..3 of row 2k (its low 8 bytes) and of row 2k + 1
     * (its high 8) interleaved: column j's channels 4k .. 4k + 3 in lane j */
    const __m256i interleave = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                                0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    /* vectors c (2 vpmaddubsw each) summed in int16 before vpmaddwd: see the exactness above */
    const int chunk = bits == 4 ? 4 : bits == 5 ? 2 : 1;
    __m256 tot[2][ROWS_I8], block[2][ROWS_I8]; /* [half]; block: as the VNNI build's (k256) */
    __m256i acc16[2][ROWS_I8], acc32[2][ROWS_I8];
#pragma GCC unroll 2
    for (int hc = 0; hc < 2; hc++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            tot[hc][r] = block[hc][r] = _mm256_setzero_ps();
            acc16[hc][r] = acc32[hc][r] = _mm256_setzero_si256();
        }
    /* one pass, k256: the super-block's d and -dmin of each half's 8 columns in fp32, converted
     * once for its groups (as the VNNI build's tile_rows: the same bits) */
    const int64_t k_bytes = k_block_bytes(a->format), nsub = g16 ? 16 : 8;
    const uint8_t *super_at = NULL;
    __m256 super_d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, super_m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const far_t scales_far = scales_ahead(a, t);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * tb;
        for (int line = 0; line < tb; line += 64) PREFETCH_CODES(gc + line + PREFETCH_BYTES);
        if (PREFETCH_SCALES && !scales) PREFETCH_CODES(scales_far.at + g * scales_far.step);
        prefetch_far(far, g);
        const int8_t *xg = xq + g * ROWS_I8 * GROUP;
        if (HOIST_SUPER_SCALES && k256 && !scales && (g & 7) == 0) { /* a super-block starts */
            super_at = a->scales + (t * (a->K >> 8) + (g >> 3)) * k_bytes;
#pragma GCC unroll 2
            for (int hc = 0; hc < 2; hc++) {
                super_d[hc] = load_scales8(super_at + hc * 16, 0);
                if (with_m) super_m[hc] = load_scales8(super_at + 2 * TILE + hc * 16, 0);
            }
        }
        int n16 = 0, n32 = 0; /* vectors c in acc16, widenings in acc32: constants once unrolled */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* channels 16h .. 16h + 15 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2;
                __m256i lo[2], hi[2], ulo[2], uhi[2];
#pragma GCC unroll 2
                for (int hc = 0; hc < 2; hc++) {
                    if (bits == 8) { /* rows 4c .. 4c + 3, this half's 16 bytes of each */
                        const uint8_t *row = gc + 4 * c * 2 * TILE + hc * 16;
                        const __m256i r01 = _mm256_inserti128_si256(
                            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)row)),
                            _mm_loadu_si128((const __m128i *)(row + 2 * TILE)), 1);
                        const __m256i r23 = _mm256_inserti128_si256(
                            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + 4 * TILE))),
                            _mm_loadu_si128((const __m128i *)(row + 6 * TILE)), 1);
                        lo[hc] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(r01, 0xD8), interleave);
                        hi[hc] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(r23, 0xD8), interleave);
                    } else if (unpacked) { /* tile_unpack's, for every pass of the panel */
                        const uint8_t *at = unpacked + ((g * 2 + hc) * 4 + c) * 64;
                        lo[hc] = _mm256_load_si256((const __m256i *)at);
                        hi[hc] = _mm256_load_si256((const __m256i *)(at + 32));
                    } else {
                        unpack_vector(gc, hc, c, bits, &lo[hc], &hi[hc]);
                    }
                    ulo[hc] = bits == 8 ? _mm256_abs_epi8(lo[hc]) : lo[hc];
                    uhi[hc] = bits == 8 ? _mm256_abs_epi8(hi[hc]) : hi[hc];
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i x0 = broadcast4(xg + r * GROUP + 8 * c), x1 = broadcast4(xg + r * GROUP + 8 * c + 4);
#pragma GCC unroll 2
                    for (int hc = 0; hc < 2; hc++) {
                        if (AVX_VNNI) { /* u qx summed into int32 by the instruction itself */
                            const __m256i xa = bits == 8 ? _mm256_sign_epi8(x0, lo[hc]) : x0;
                            const __m256i xb = bits == 8 ? _mm256_sign_epi8(x1, hi[hc]) : x1;
                            /* a vector's two products from zero, then one add: a running sum
                             * through every vpdpbusd would wait on its latency (0.79x at 16 rows) */
                            const __m256i s = dpbusd(dpbusd(_mm256_setzero_si256(), ulo[hc], xa), uhi[hc], xb);
                            acc32[hc][r] = n32 ? _mm256_add_epi32(acc32[hc][r], s) : s;
                            __asm__("" : "+x"(acc32[hc][r])); /* (below) */
                        } else if (bits == 8) { /* |q| x sign(qx, q) = q qx; a pair fits int16, two may not */
                            const __m256i s = _mm256_add_epi32(
                                _mm256_madd_epi16(_mm256_maddubs_epi16(ulo[hc], _mm256_sign_epi8(x0, lo[hc])), ones),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(uhi[hc], _mm256_sign_epi8(x1, hi[hc])), ones));
                            acc32[hc][r] = n32 ? _mm256_add_epi32(acc32[hc][r], s) : s;
                            __asm__("" : "+x"(acc32[hc][r])); /* (below) */
                        } else {
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(ulo[hc], x0), _mm256_maddubs_epi16(uhi[hc], x1));
                            acc16[hc][r] = n16 ? _mm256_add_epi16(acc16[hc][r], p) : p;
                            /* the sum here, in a register: else GCC reassociates the integer adds to
                             * the group's end and keeps every row's broadcast x on the stack until then */
                            __asm__("" : "+x"(acc16[hc][r]));
                        }
                    }
                }
                const int group_end = c2 == 1 && (g16 || h == 1); /* a scale group ends */
                if (AVX_VNNI || bits == 8) {
                    n32++;
                } else if (++n16 == chunk || group_end) { /* widen: pairs of int16 into int32 */
#pragma GCC unroll 2
                    for (int hc = 0; hc < 2; hc++)
#pragma GCC unroll 4
                        for (int r = 0; r < R; r++) {
                            const __m256i s = _mm256_madd_epi16(acc16[hc][r], ones);
                            acc32[hc][r] = n32 ? _mm256_add_epi32(acc32[hc][r], s) : s;
                        }
                    n16 = 0;
                    n32++;
                }
                if (group_end) {
                    const int64_t s = g * per + (g16 ? h : 0);
#pragma GCC unroll 2
                    for (int hc = 0; hc < 2; hc++) {
                        __m256 d, m = _mm256_setzero_ps();
                        if (scales) { /* formed once for the tile's passes */
                            d = _mm256_load_ps(scales + s * 2 * TILE + hc * 8);
                            if (with_m) m = _mm256_load_ps(scales + s * 2 * TILE + TILE + hc * 8);
                        } else if (HOIST_SUPER_SCALES && k256) { /* one pass: this group's sc and mn */
                            const int8_t *sc = (const int8_t *)(super_at + (with_m ? 4 : 2) * TILE) + (s & (nsub - 1)) * TILE + hc * 8;
                            d = _mm256_mul_ps(super_d[hc], int8x8(sc));
                            if (with_m) m = _mm256_mul_ps(super_m[hc], int8x8(sc + nsub * TILE));
                        } else { /* one pass (a decode step): formed here */
                            group_scales(a, t, s, hc, &d, &m);
                        }
#pragma GCC unroll 4
                        for (int r = 0; r < R; r++) {
                            const __m256i sum = off ? _mm256_add_epi32(acc32[hc][r], _mm256_set1_epi32(xoff[s * ROWS_I8 + r]))
                                                    : acc32[hc][r];
                            if (k256) {
                                block[hc][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, block[hc][r]);
                                if (with_m) block[hc][r] = _mm256_fmadd_ps(_mm256_set1_ps(x_sums[s * ROWS_I8 + r]), m, block[hc][r]);
                            } else {
                                const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(xs[g * ROWS_I8 + r]));
                                tot[hc][r] = _mm256_fmadd_ps(part, d, tot[hc][r]);
                                if (with_m) tot[hc][r] = _mm256_fmadd_ps(_mm256_set1_ps(x_sums[s * ROWS_I8 + r]), m, tot[hc][r]);
                            }
                        }
                    }
                    n32 = 0;
                }
            }
        }
        if (k256 && (g & 7) == 7) { /* a super-block ends */
#pragma GCC unroll 2
            for (int hc = 0; hc < 2; hc++)
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    tot[hc][r] = _mm256_fmadd_ps(block[hc][r], _mm256_set1_ps(xs[g * ROWS_I8 + r]), tot[hc][r]);
                    block[hc][r] = _mm256_setzero_ps();
                }
        }
    }
    for (int hc = 0; hc < 2; hc++) store_rows8(a, t, hc, r0, R, tot[hc]);
}


/* A tile's d and m in fp32 for every scale group, 16 each (the rows' passes read them, formed once) */
static void tile_scales(const args_t *a, int64_t t, float *out) {
    const int64_t sgroups = a->K / group_size(a->format);
    for (int64_t s = 0; s < sgroups; s++)
        for (int hc = 0; hc < 2; hc++) {
            __m256 d, m = _mm256_setzero_ps();
            group_scales(a, t, s, hc, &d, &m);
            _mm256_store_ps(out + s * 2 * TILE + hc * 8, d);
            _mm256_store_ps(out + s * 2 * TILE + TILE + hc * 8, m);
        }
}

/* Rows [lo, hi) of x -> their int8 codes (PERM4 order but for 8-bit codes), scales, -off *
 * sum(qx) and (F_M) s sum(qx) per scale group: the VNNI build's values, the same fp32
 * operations (amax, 127 / amax, x * that rounded to nearest even, amax / 127). */
static void *quantize_rows(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    const int format = a->format, off = code_offset(format), k256 = !!(format & F_K);
    const int with_m = (format & F_M) && !(format & F_M8);
    const int64_t groups = a->K / GROUP;
    int perm[8];
    for (int i = 0; i < 8; i++) perm[i] = format & F_BITS8 ? i : PERM4[i];
    const __m256i idx = _mm256_loadu_si256((const __m256i *)perm);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes vpackssdw / vpacksswb's lanes */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = p->lo; r < p->hi; r++) {
        const uint16_t *x = a->x + r * a->x_stride;
        int8_t *q = a->xq + blocked(r, groups, 0, ROWS_I8) * GROUP; /* group g at q + g ROWS_I8 GROUP */
        float amax = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4]; /* channels 8i .. 8i + 7 */
            for (int i = 0; i < 4; i++) v[i] = load_bf16x8_i(x + g * GROUP + 8 * i);
            if (!k256 || (g & 7) == 0) { /* per group, or (K-quants) per super-block of 8 groups */
                __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
                for (int64_t e = 1; e < (k256 ? 8 : 1); e++)
                    for (int i = 0; i < 4; i++)
                        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, load_bf16x8_i(x + (g + e) * GROUP + 8 * i)));
                __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(top, 1), _mm256_castps256_ps128(top));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            a->xs[blocked(r, groups, g, ROWS_I8)] = amax / 127.0f;
            const __m256 scale = _mm256_set1_ps(inv);
            __m256i qi[4];
            for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(v[i], idx), scale));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(q + g * ROWS_I8 * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
            if (off || with_m) /* (store_x_sums) */
                store_x_sums(a, r, g, sum8_epi32(_mm256_add_epi32(qi[0], qi[1])), sum8_epi32(_mm256_add_epi32(qi[2], qi[3])),
                             amax, off, ROWS_I8);
        }
    }
    return NULL;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLINK_QUANT_ISA 2

/* Rows [r0, r0 + R) x columns 8 hc .. 8 hc + 7 of tile t, R <= ROWS2 known at compile time. */
static inline __attribute__((always_inline)) void half_rows(const args_t *a, int64_t t, int hc, int64_t r0,
                                                            const int R, const int bits) {
    const int format = a->format, with_m = format & F_M, g16 = format & F_GROUP16, bits8 = bits == 8;
    const int64_t groups = a->K / GROUP, tb = tile_bytes(format);
    const int64_t sgroups = a->K / group_size(format), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
    const float *x = a->xf + r0 * a->K;
    const float *x_sums = with_m ? a->x_sums + r0 * sgroups : NULL;
    const __m256i nibble = _mm256_set1_epi32(0x0F), top2 = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32),
                  bit4 = _mm256_set1_epi32(0x10);
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
            for (int line = 0; line < tb; line += 64) PREFETCH_CODES(gc + line + PREFETCH_BYTES);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2;
                const __m256i words = bits8 ? _mm256_setzero_si256()
                                            : _mm256_loadu_si256((const __m256i *)(gc + c * 64 + hc * 32));
                const __m256i high = bits == 6   ? _mm256_loadu_si256((const __m256i *)(gc + 256 + h * 64 + hc * 32))
                                     : bits == 5 ? _mm256_loadu_si256((const __m256i *)(gc + 256 + hc * 32))
                                                 : _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const int p = 4 * c + i;
                    __m256i even, odd; /* each 32-bit lane: column j's codes at channels 2p, 2p + 1 */
                    if (bits8) {
                        const __m256i v = _mm256_cvtepi8_epi16(
                            _mm_loadu_si128((const __m128i *)(gc + p * 2 * TILE + hc * 16)));
                        even = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16);
                        odd = _mm256_srai_epi32(v, 16);
                    } else if (bits == 6) { /* nibble | 2 high bits << 4, minus 32 */
                        const int up = 4 - POS6[4 * c2 + i];
                        const __m256i hs = up > 0 ? _mm256_slli_epi32(high, up) : _mm256_srli_epi32(high, -up);
                        even = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words, 4 * i), nibble),
                                               _mm256_and_si256(hs, top2));
                        odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words, 16 + 4 * i), nibble),
                                              _mm256_and_si256(_mm256_srli_epi32(hs, 16), top2));
                        even = _mm256_sub_epi32(even, off);
                        odd = _mm256_sub_epi32(odd, off);
                    } else if (bits == 5) { /* nibble | top bit << 4 */
                        const int up = 4 - p;
                        const __m256i hs = up > 0 ? _mm256_slli_epi32(high, up) : _mm256_srli_epi32(high, -up);
                        even = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words, 4 * i), nibble),
                                               _mm256_and_si256(hs, bit4));
                        odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(words, 16 + 4 * i), nibble),
                                              _mm256_and_si256(_mm256_srli_epi32(hs, 16), bit4));
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
                __m256 d, m = _mm256_setzero_ps();
                group_scales(a, t, s, hc, &d, &m);
                if (with_m) {
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
    store_rows8(a, t, hc, r0, R, tot);
}

#define CASE(R)                                                                                   \
    case R:                                                                                       \
        if (a->format & F_BITS8) half_rows(a, t, hc, r0, R, 8);                                  \
        else if (a->format & F_BITS6) half_rows(a, t, hc, r0, R, 6);                             \
        else if (a->format & F_BITS5) half_rows(a, t, hc, r0, R, 5);                             \
        else half_rows(a, t, hc, r0, R, 4);                                                      \
        break;

static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows) {
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
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define BLINK_QUANT_ISA 82
#include <arm_neon.h>
/* The Arm int8 build (Armv8.2-A with the dot-product extension, -march=armv8.2-a+dotprod: Arm
 * Neoverse N1 / V1 / N2 / V2 servers such as AWS Graviton 2-4, Ampere Altra, Google Axion;
 * Apple M1 and later).
 *
 * Why: as on x86 without AMX, a decode step streams every weight once; sdot multiplies 16
 * signed byte pairs an instruction into four int32 sums, so x is quantized to int8 as the x86
 * int8 builds quantize it (quantize_activations' values) and each group's x . q is an exact
 * int32 sum, then the same epilogue in the same fp32 order:
 *   y += (s * (sum(u qx) - off sum(qx))) * d + (s * sum(qx)) * m      per scale group
 * (k256: per super-block, as the VNNI build's tile_rows), so this build gives the x86 int8
 * builds' bits (tests/test_cpu_quant_linear_arm.py runs it under qemu-user against them).
 * Exactness: the codes as bytes (4/5/6-bit: u in 0..63; 8-bit: q itself, signed, no offset)
 * times qx in -127..127, at most 32 x 63 x 127 a group: no int32 overflows, no saturation.
 * Codes: the 4-bit layout's 64-byte vector c holds the tile's 16 columns in 32-bit lanes (as
 * the VNNI build reads it), here four registers of 4 columns each (quads); masked to the low
 * nibbles a lane holds its column's channels 8c, 8c + 4, 8c + 1, 8c + 5, shifted down by 4
 * its 8c + 2, 8c + 6, 8c + 3, 8c + 7: x's codes in PERM4 order, so one 32-bit word of x,
 * broadcast (ld1r), meets a lane's 4 codes in one sdot. 5/6-bit top bits shifted and masked
 * into bits 4 (and 5) of each byte as the AVX2 int8 build does; 8-bit rows 4c, 4c + 1 (and
 * 4c + 2, 4c + 3) zipped by 16-bit words into each column's channels in order.
 * Speed: chosen by design, not measured (no Arm machine here; qemu-user's times say nothing
 * about a core): rows per pass and the work per thread are the AVX2 int8 build's. */
#define BLINK_QUANT_INT8 1

/* rows per pass over a tile, and x's block (blocked) */
enum { ROWS_A = 4 };
#define BLINK_QUANT_INT8_ROWS ROWS_A
#define BLINK_QUANT_INT8_ROW_CASES(U) CASE(1, U) CASE(2, U) CASE(3, U) CASE(4, U)
/* work per thread, in (passes x weights): the AVX2 int8 build's (not measured on Arm) */
#define BLINK_QUANT_INT8_PER_THREAD ((int64_t)1 << 17)

/* channel of the group at position 8c + e of x's int8 codes: 4-bit layouts (5, 6 too) */
static const int PERM4[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/* 4 fp16 (or fp32) scales from p as fp32 */
static inline float32x4_t load_scales4(const uint8_t *p, int fp32) {
    if (fp32) return vld1q_f32((const float *)(const void *)p);
    uint16x4_t h;
    memcpy(&h, p, sizeof h);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* 4 int8 as fp32 (a 4-byte load: the last quad's 4 bytes may end the buffer) */
static inline float32x4_t int8x4(const int8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
}

/* Scale group s of tile t, columns 4 q .. 4 q + 3: d and (F_M) m in fp32 (as the x86 builds'
 * group_scales: the same values) */
static inline void group_scales(const args_t *a, int64_t t, int64_t s, int q, float32x4_t *d, float32x4_t *m) {
    const scale_at_t at = scale_at(a, t, s);
    if (a->format & F_K) {
        *d = vmulq_f32(load_scales4(at.d16 + q * 8, 0), int8x4(at.sc + q * 4));
        if (a->format & F_M) *m = vmulq_f32(load_scales4(at.dm16 + q * 8, 0), int8x4(at.mn + q * 4));
    } else {
        const int64_t esize = a->format & F_FP32 ? 4 : 2;
        *d = load_scales4(at.d16 + q * 4 * esize, a->format & F_FP32);
        if (a->format & F_M8) *m = vmulq_f32(*d, vdupq_n_f32(-8.0f)); /* exact */
        else if (a->format & F_M) *m = load_scales4(at.dm16 + q * 4 * esize, a->format & F_FP32);
    }
}

/* off: what comes off each code before d (Q4_0 8, Q6_K 32), 0 where m holds the min and for
 * 8-bit codes (signed here, as in the AVX2 int8 build) */
static inline int code_offset(int format) {
    return format & F_BITS8 ? 0 : format & F_BITS6 ? 32 : format & F_M8 ? 8 : 0;
}

/* a 16-bit shift by n (left) or -n (right) */
static inline uint16x8_t shift16(uint16x8_t h, const int n) { return vshlq_u16(h, vdupq_n_s16((int16_t)n)); }
/* an 8-bit shift by n (left) or -n (right) */
static inline uint8x16_t shift8(uint8x16_t h, const int n) { return vshlq_u8(h, vdupq_n_s8((int8_t)n)); }

/* Vector c of group g's codes `gc` as bytes, quad q (columns 4q .. 4q + 3): 4/5/6-bit codes'
 * low nibbles (lo) and high nibbles (hi) as the VNNI build's unpack_vector gives them, the 5/6-bit
 * top bits in place; 8-bit codes' rows 4c, 4c + 1 (lo) and 4c + 2, 4c + 3 (hi) zipped into each
 * column's channels 8c .. 8c + 3 (8c + 4 .. 8c + 7), signed. */
static inline __attribute__((always_inline)) void unpack_vector(const uint8_t *gc, int c, int q, const int bits,
                                                                int8x16_t *lo_out, int8x16_t *hi_out) {
    if (bits == 8) { /* row p at gc + 32 p; a column's two channels are a 16-bit word */
        const uint16x4_t r0 = vreinterpret_u16_u8(vld1_u8(gc + (4 * c) * 32 + 8 * q));
        const uint16x4_t r1 = vreinterpret_u16_u8(vld1_u8(gc + (4 * c + 1) * 32 + 8 * q));
        const uint16x4_t r2 = vreinterpret_u16_u8(vld1_u8(gc + (4 * c + 2) * 32 + 8 * q));
        const uint16x4_t r3 = vreinterpret_u16_u8(vld1_u8(gc + (4 * c + 3) * 32 + 8 * q));
        const uint16x4x2_t z01 = vzip_u16(r0, r1), z23 = vzip_u16(r2, r3);
        *lo_out = vreinterpretq_s8_u16(vcombine_u16(z01.val[0], z01.val[1]));
        *hi_out = vreinterpretq_s8_u16(vcombine_u16(z23.val[0], z23.val[1]));
        return;
    }
    const int h = c / 2, c2 = c % 2;
    const uint8x16_t v = vld1q_u8(gc + c * 64 + q * 16);
    uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(v, 4);
    if (bits == 6) { /* byte b of the plane holds the high bits of byte b of lo and hi (POS6) */
        const uint8x16_t high6 = vld1q_u8(gc + 256 + h * 64 + q * 16), top = vdupq_n_u8(0x30);
        lo = vorrq_u8(lo, vandq_u8(shift8(high6, 4 - 4 * c2), top));
        hi = vorrq_u8(hi, vandq_u8(shift8(high6, 2 - 4 * c2), top));
    } else if (bits == 5) {
        /* lo's bytes are rows 4c (a word's low byte) and 4c + 2 (high byte), hi's 4c + 1 and
         * 4c + 3; a row's top bit goes to bit 4 of its byte */
        const uint16x8_t high5 = vreinterpretq_u16_u8(vld1q_u8(gc + 256 + q * 16));
        const uint16x8_t top_lo = vdupq_n_u16(0x0010), top_hi = vdupq_n_u16(0x1000);
        const int jb = 4 * c; /* row 4c's bit in high5 */
        const uint16x8_t lo_top = vorrq_u16(vandq_u16(shift16(high5, 4 - jb), top_lo),
                                            vandq_u16(shift16(high5, 12 - (jb + 2)), top_hi));
        const uint16x8_t hi_top = vorrq_u16(vandq_u16(shift16(high5, 4 - (jb + 1)), top_lo),
                                            vandq_u16(shift16(high5, 12 - (jb + 3)), top_hi));
        lo = vorrq_u8(lo, vreinterpretq_u8_u16(lo_top));
        hi = vorrq_u8(hi, vreinterpretq_u8_u16(hi_top));
    }
    *lo_out = vreinterpretq_s8_u8(lo);
    *hi_out = vreinterpretq_s8_u8(hi);
}

/* Whether a panel's passes read a tile's codes unpacked once (tile_unpack): every format */
static inline int unpacks(int format) { (void)format; return 1; }
/* from 4 passes (16 rows), as the AVX2 int8 build's (not measured on Arm) */
enum { UNPACK_MIN_PASSES = 4 };

/* bytes of one tile's unpacked codes (tile_unpack): per group and vector c, lo then hi, 64 each */
static inline int64_t unpacked_bytes(int64_t K) { return K / GROUP * 4 * 2 * 64; }

/* Tile t's codes unpacked once for a panel's passes (tile_rows' `unpacked`) */
static void tile_unpack(const args_t *a, int64_t t, uint8_t *out) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int bits = a->format & F_BITS8 ? 8 : a->format & F_BITS6 ? 6 : a->format & F_BITS5 ? 5 : 4;
    const uint8_t *codes = a->codes + t * groups * tb;
    for (int64_t g = 0; g < groups; g++)
        for (int c = 0; c < 4; c++)
            for (int q = 0; q < 4; q++) {
                int8x16_t lo, hi;
                if (bits == 8) unpack_vector(codes + g * tb, c, q, 8, &lo, &hi);
                else if (bits == 6) unpack_vector(codes + g * tb, c, q, 6, &lo, &hi);
                else if (bits == 5) unpack_vector(codes + g * tb, c, q, 5, &lo, &hi);
                else unpack_vector(codes + g * tb, c, q, 4, &lo, &hi);
                int8_t *at = (int8_t *)out + (g * 4 + c) * 128 + q * 16;
                vst1q_s8(at, lo);
                vst1q_s8(at + 64, hi);
            }
}

/* Rows [r0, r0 + R) x the 16 columns of tile t (four quads); r0 a multiple of ROWS_A (x in
 * blocks of ROWS_A rows: blocked). R <= ROWS_A, the code width, whether m is stored, the
 * codes' offset, g16 and k256 are known at compile time once inlined (tile_pass' kinds), so
 * the loop holds no test of the format; scales: the tile's fp32 d and m per scale group
 * (tile_scales), NULL: formed here. As the VNNI build's tile_rows, operation for operation in
 * fp32. */
static inline __attribute__((always_inline)) void tile_rows(const args_t *a, int64_t t, int64_t r0, const int R,
                                                            const int bits, const int with_m, const int off,
                                                            const int g16, const int k256, const float *scales,
                                                            far_t far, const uint8_t *unpacked) {
    const int64_t groups = a->K / GROUP, tb = tile_bytes(a->format);
    const int64_t sgroups = a->K / (g16 ? 16 : GROUP), per = g16 ? 2 : 1;
    const uint8_t *codes = a->codes + t * groups * tb;
    const int8_t *xq = a->xq + blocked(r0, groups, 0, ROWS_A) * GROUP; /* group g, row r: xq + (g ROWS_A + r) GROUP */
    const float *xs = a->xs + blocked(r0, groups, 0, ROWS_A);          /* xs[g ROWS_A + r] */
    const int32_t *xoff = a->xoff + blocked(r0, sgroups, 0, ROWS_A);   /* -off sum(qx): xoff[s ROWS_A + r] */
    const float *x_sums = a->x_sums + blocked(r0, sgroups, 0, ROWS_A); /* s sum(qx): x_sums[s ROWS_A + r] */
    int32x4_t acc[ROWS_A][4];
    float32x4_t tot[ROWS_A][4], block[ROWS_A][4]; /* block: k256's sum over the super-block so far */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            tot[r][q] = block[r][q] = vdupq_n_f32(0.0f);
            acc[r][q] = vdupq_n_s32(off ? xoff[r] : 0);
        }
    /* one pass, k256: the super-block's fp16 d and -dmin in fp32, converted once for its groups */
    const int64_t k_bytes = k_block_bytes(a->format), nsub = g16 ? 16 : 8;
    const uint8_t *super_at = NULL;
    float32x4_t super_d[4], super_m[4];
    for (int q = 0; q < 4; q++) super_d[q] = super_m[q] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * tb;
        for (int line = 0; line < tb; line += 64) PREFETCH_CODES(gc + line + PREFETCH_BYTES);
        prefetch_far(far, g);
        const int8_t *xg = xq + g * ROWS_A * GROUP;
        if (HOIST_SUPER_SCALES && k256 && !scales && (g & 7) == 0) { /* a super-block starts */
            super_at = a->scales + (t * (a->K >> 8) + (g >> 3)) * k_bytes;
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                super_d[q] = load_scales4(super_at + q * 8, 0);
                if (with_m) super_m[q] = load_scales4(super_at + 2 * TILE + q * 8, 0);
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* channels 16h .. 16h + 15 */
#pragma GCC unroll 2
            for (int c2 = 0; c2 < 2; c2++) {
                const int c = 2 * h + c2;
                int8x16_t lo[4], hi[4];
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    if (unpacked) { /* tile_unpack's, for every pass of the panel */
                        const int8_t *at = (const int8_t *)unpacked + (g * 4 + c) * 128 + q * 16;
                        lo[q] = vld1q_s8(at);
                        hi[q] = vld1q_s8(at + 64);
                    } else {
                        unpack_vector(gc, c, q, bits, &lo[q], &hi[q]);
                    }
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    /* x's 4 codes of each half of the vector in every lane (ld1r) */
                    const int8_t *xc = xg + r * GROUP + 8 * c;
                    const int8x16_t x0 = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)xc));
                    const int8x16_t x1 = vreinterpretq_s8_s32(vld1q_dup_s32((const int32_t *)(const void *)(xc + 4)));
#pragma GCC unroll 4
                    for (int q = 0; q < 4; q++) acc[r][q] = vdotq_s32(vdotq_s32(acc[r][q], lo[q], x0), hi[q], x1);
                }
            }
            if (g16 || h == 1) { /* a scale group ends */
                const int64_t s = g * per + (g16 ? h : 0);
                const int64_t s_next = s + 1 < sgroups ? s + 1 : s; /* (the last one's start is not used) */
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    float32x4_t d, m = vdupq_n_f32(0.0f);
                    if (scales) { /* formed once for the tile's passes */
                        d = vld1q_f32(scales + s * 2 * TILE + q * 4);
                        if (with_m) m = vld1q_f32(scales + s * 2 * TILE + TILE + q * 4);
                    } else if (HOIST_SUPER_SCALES && k256) { /* one pass: this group's sc and mn */
                        const int8_t *sc = (const int8_t *)(super_at + (with_m ? 4 : 2) * TILE) + (s & (nsub - 1)) * TILE + q * 4;
                        d = vmulq_f32(super_d[q], int8x4(sc));
                        if (with_m) m = vmulq_f32(super_m[q], int8x4(sc + nsub * TILE));
                    } else { /* one pass (a decode step): formed here */
                        group_scales(a, t, s, q, &d, &m);
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const float32x4_t sum = vcvtq_f32_s32(acc[r][q]);
                        if (k256) {
                            block[r][q] = vfmaq_f32(block[r][q], sum, d);
                            if (with_m) block[r][q] = vfmaq_f32(block[r][q], vdupq_n_f32(x_sums[s * ROWS_A + r]), m);
                        } else {
                            const float32x4_t part = vmulq_f32(sum, vdupq_n_f32(xs[g * ROWS_A + r]));
                            tot[r][q] = vfmaq_f32(tot[r][q], part, d);
                            if (with_m) tot[r][q] = vfmaq_f32(tot[r][q], vdupq_n_f32(x_sums[s * ROWS_A + r]), m);
                        }
                        acc[r][q] = vdupq_n_s32(off ? xoff[s_next * ROWS_A + r] : 0);
                    }
                }
            }
        }
        if (k256 && (g & 7) == 7) { /* a super-block ends */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    tot[r][q] = vfmaq_f32(tot[r][q], block[r][q], vdupq_n_f32(xs[g * ROWS_A + r]));
                    block[r][q] = vdupq_n_f32(0.0f);
                }
        }
    }
    float bias[TILE] = {0};
    if (a->bias)
        for (int j = 0; j < TILE; j++) bias[j] = bf16_to_f32(a->bias[t * TILE + j]);
    for (int r = 0; r < R; r++) {
        float out[TILE];
        for (int q = 0; q < 4; q++) vst1q_f32(out + 4 * q, vaddq_f32(tot[r][q], vld1q_f32(bias + 4 * q)));
        uint16_t *y = a->y + (r0 + r) * a->y_stride + t * TILE;
        for (int j = 0; j < TILE; j++) y[j] = f32_to_bf16(out[j]);
    }
}

/* A tile's d and m in fp32 for every scale group, 16 each (the rows' passes read them, formed once) */
static void tile_scales(const args_t *a, int64_t t, float *out) {
    const int64_t sgroups = a->K / group_size(a->format);
    for (int64_t s = 0; s < sgroups; s++)
        for (int q = 0; q < 4; q++) {
            float32x4_t d, m = vdupq_n_f32(0.0f);
            group_scales(a, t, s, q, &d, &m);
            vst1q_f32(out + s * 2 * TILE + q * 4, d);
            vst1q_f32(out + s * 2 * TILE + TILE + q * 4, m);
        }
}

/* Rows [lo, hi) of x -> their int8 codes (PERM4 order but for 8-bit codes), scales, -off *
 * sum(qx) and (F_M) s sum(qx) per scale group: the x86 int8 builds' values, the same fp32
 * operations (amax, 127 / amax, x * that rounded to nearest even, amax / 127). */
static void *quantize_rows(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    const int format = a->format, off = code_offset(format), k256 = !!(format & F_K);
    const int with_m = (format & F_M) && !(format & F_M8);
    const int64_t groups = a->K / GROUP;
    int perm[GROUP];
    for (int i = 0; i < GROUP; i++) perm[i] = format & F_BITS8 ? i : (i & ~7) + PERM4[i & 7];
    for (int64_t r = p->lo; r < p->hi; r++) {
        const uint16_t *x = a->x + r * a->x_stride;
        int8_t *q = a->xq + blocked(r, groups, 0, ROWS_A) * GROUP; /* group g at q + g ROWS_A GROUP */
        float amax = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            if (!k256 || (g & 7) == 0) { /* per group, or (K-quants) per super-block of 8 groups */
                float32x4_t top = vdupq_n_f32(0.0f);
                for (int64_t c = 0; c < (k256 ? 8 : 1) * GROUP; c += 4) {
                    const uint32x4_t bits = vshll_n_u16(vld1_u16(x + g * GROUP + c), 16);
                    top = vmaxq_f32(top, vabsq_f32(vreinterpretq_f32_u32(bits)));
                }
                amax = vmaxvq_f32(top);
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            a->xs[blocked(r, groups, g, ROWS_A)] = amax / 127.0f;
            float v[GROUP];
            for (int i = 0; i < GROUP; i++) v[i] = bf16_to_f32(x[g * GROUP + perm[i]]);
            int32x4_t qi[8];
            for (int i = 0; i < 8; i++) qi[i] = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(v + 4 * i), vdupq_n_f32(inv)));
            for (int i = 0; i < 2; i++) { /* saturating narrowing, as vpackssdw / vpacksswb */
                const int16x8_t w0 = vcombine_s16(vqmovn_s32(qi[4 * i]), vqmovn_s32(qi[4 * i + 1]));
                const int16x8_t w1 = vcombine_s16(vqmovn_s32(qi[4 * i + 2]), vqmovn_s32(qi[4 * i + 3]));
                vst1q_s8(q + g * ROWS_A * GROUP + 16 * i, vcombine_s8(vqmovn_s16(w0), vqmovn_s16(w1)));
            }
            if (off || with_m) /* (store_x_sums) */
                store_x_sums(a, r, g, vaddvq_s32(vaddq_s32(vaddq_s32(qi[0], qi[1]), vaddq_s32(qi[2], qi[3]))),
                             vaddvq_s32(vaddq_s32(vaddq_s32(qi[4], qi[5]), vaddq_s32(qi[6], qi[7]))), amax, off, ROWS_A);
        }
    }
    return NULL;
}

#endif

/* Which instruction set this build uses: 8 (AVX-512 VNNI, int8), 512 (AVX-512 with BF16), 28 (AVX2, int8), 29
 * (AVX2 with AVX-VNNI, int8), 2
 * (AVX2), 82 (Arm NEON with the dot-product extension, int8), 0 (none: the Python side does not use it). */
int blink_quant_linear_isa(void) {
#ifdef BLINK_QUANT_ISA
    return BLINK_QUANT_ISA;
#else
    return 0;
#endif
}

#ifdef BLINK_QUANT_ISA
/* Each row's fp32 sum over each scale group (in channel order). */
static inline __attribute__((unused)) void group_sums(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t group, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < K / group; g++) {
            float s = 0.0f;
            for (int64_t c = 0; c < group; c++) s += bf16_to_f32(x[r * x_stride + g * group + c]);
            out[r * (K / group) + g] = s;
        }
}
#endif

#ifdef BLINK_QUANT_INT8
/* A pass of both int8 builds over tile t: their tile_rows with the format's kind known at compile
 * time, each kind its own loop (bits, m stored, the codes' offset, 16-channel groups; an 8-bit
 * code's offset is the build's own, code_offset: VNNI's u = q + 128, none with AVX2's sign
 * trick), and the rows (1 to BLINK_QUANT_INT8_ROWS: the build's BLINK_QUANT_INT8_ROW_CASES). */
#define KINDS(R, U)                                                                                   \
    if (k256 && bits == 4 && with_m && !g16) tile_rows(a, t, r0, R, 4, 1, 0, 0, 1, scales, far, U);  /* Q4_K */ \
    else if (k256 && bits == 6 && !with_m && off == 32 && g16) tile_rows(a, t, r0, R, 6, 0, 32, 1, 1, scales, far, U); /* Q6_K */ \
    else if (k256 && bits == 5 && with_m && !g16) tile_rows(a, t, r0, R, 5, 1, 0, 0, 1, scales, far, U); /* Q5_K */ \
    else if (bits == 4 && with_m && !g16) tile_rows(a, t, r0, R, 4, 1, 0, 0, 0, scales, far, U);  /* Q4_1 */  \
    else if (bits == 4 && !with_m && off == 8 && !g16) tile_rows(a, t, r0, R, 4, 0, 8, 0, 0, scales, far, U); /* Q4_0 */ \
    else if (bits == 8 && !with_m && off == q8_off && !g16) tile_rows(a, t, r0, R, 8, 0, q8_off, 0, 0, scales, far, U); /* Q8_0 */ \
    else if (bits == 8) tile_rows(a, t, r0, R, 8, with_m, off, g16, k256, scales, far, U);                     \
    else if (bits == 6) tile_rows(a, t, r0, R, 6, with_m, off, g16, k256, scales, far, U);                     \
    else if (bits == 5) tile_rows(a, t, r0, R, 5, with_m, off, g16, k256, scales, far, U);                     \
    else tile_rows(a, t, r0, R, 4, with_m, off, g16, k256, scales, far, U);

#define CASE(R, U)                                                                                \
    case R:                                                                                       \
        KINDS(R, U)                                                                               \
        break;

static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows, const float *scales, far_t far,
                      const uint8_t *unpacked) {
    const int format = a->format, off = code_offset(format), g16 = !!(format & F_GROUP16);
    const int with_m = (format & F_M) && !(format & F_M8);
    const int bits = format & F_BITS8 ? 8 : format & F_BITS6 ? 6 : format & F_BITS5 ? 5 : 4;
    const int k256 = !!(format & F_K);
    const int q8_off = code_offset(F_BITS8); /* the build's, a constant once inlined */
    /* (a decode step's one pass: NULL, constant once inlined, so its loop holds no test of it) */
    if (unpacked)
        switch (rows) { BLINK_QUANT_INT8_ROW_CASES(unpacked) }
    else
        switch (rows) { BLINK_QUANT_INT8_ROW_CASES(NULL) }
}
#undef CASE
#undef KINDS

/* The int8 builds' split of a call: per panel of PANEL_ROWS rows (a larger int8 panel measured
 * 0.95-0.98x) and tile, the tile's scales formed once where the panel takes several passes of
 * BLINK_QUANT_INT8_ROWS rows (a decode step's one pass forms them inline, allocating nothing),
 * then the passes (each build's tile_scales and tile_pass). */
static void *run_tiles(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    enum { R = BLINK_QUANT_INT8_ROWS };
    float *scales = NULL;
    uint8_t *unpacked = NULL; /* tile_unpack's, where the build unpacks the format (unpacks) */
    if (a->M > R) {
        const int unpack = unpacks(a->format) && (a->M + R - 1) / R >= UNPACK_MIN_PASSES;
        scales = aligned_alloc(64, (size_t)(a->K / group_size(a->format)) * 2 * TILE * sizeof(float));
        if (unpack) unpacked = aligned_alloc(64, (size_t)unpacked_bytes(a->K));
        if (!scales || (unpack && !unpacked)) {
            free(scales);
            free(unpacked);
            p->status = -4;
            return NULL;
        }
    }
    for (int64_t p0 = 0; p0 < a->M; p0 += PANEL_ROWS) {
        const int64_t p1 = a->M - p0 < PANEL_ROWS ? a->M : p0 + PANEL_ROWS;
        const int64_t passes = (p1 - p0 + R - 1) / R, groups = a->K / GROUP, tb = tile_bytes(a->format);
        /* each pass prefetches its share of the next tile's codes (far_t) */
        const int64_t share = (tb + passes - 1) / passes;
        for (int64_t t = p->lo; t < p->hi; t++) {
            if (passes > 1) tile_scales(a, t, scales);
            /* unpacked once where enough passes share it (UNPACK_MIN_PASSES) */
            const uint8_t *shared = passes >= UNPACK_MIN_PASSES ? unpacked : NULL;
            if (shared) tile_unpack(a, t, unpacked);
            const uint8_t *next = passes > 1 && t + 1 < p->hi ? a->codes + (t + 1) * groups * tb : NULL;
            if (next) { /* and the next tile's scales, whole (its tile_scales reads them at once) */
                const int64_t sb = a->format & F_K ? (a->K >> 8) * k_block_bytes(a->format)
                                                   : (a->K / group_size(a->format)) * scale_bytes(a->format);
                for (int64_t b = 0; b < sb; b += 64) __builtin_prefetch(a->scales + (t + 1) * sb + b, 0, 2);
            }
            for (int64_t j = 0; j < passes; j++) {
                const int64_t r0 = p0 + j * R;
                const far_t far = {next ? next + j * groups * share : NULL, share};
                tile_pass(a, t, r0, (int)(p1 - r0 < R ? p1 - r0 : R), passes > 1 ? scales : NULL, far, shared);
            }
        }
    }
    free(scales);
    free(unpacked);
    return NULL;
}
#endif

/* The parts a call's `tiles` output tiles are claimed in: one a thread, and for a call of one
 * pass over the tiles (`passes`, a decode step's few rows) up to 8 a thread where each keeps 128
 * tiles or more (a tile's columns do not depend on the split). Claimed in turn, they even out
 * two threads' speeds: SmolLM2's head (3,072 tiles, 30 MB) in two halves had one thread idle
 * 3-60 us a decode step while the other finished its half. (Calls of several passes keep one
 * part a thread: each part reads all of x's panels; not measured with more.) */
static inline int64_t tile_parts(int64_t tiles, int threads, int64_t passes) {
    if (passes > 1) return threads;
    int64_t per_thread = tiles / ((int64_t)threads * 128);
    if (per_thread > 8) per_thread = 8;
    return per_thread < 1 ? threads : per_thread * threads;
}

/* Returns 0; -2 for shapes or formats this kernel does not take; -3 where this build has no
 * kernel; -4 out of memory. `threads` split the output tiles when the product is large enough
 * to pay for them. */
int blink_quant_linear(const uint16_t *x, int64_t x_stride, const void *codes, const void *scales,
                       const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                       int format, int threads) {
    if (M < 1 || N % TILE || K % GROUP || x_stride < K || y_stride < N || format < 0 || format > 255 ||
        ((format & F_M8) && (!(format & F_M) || (format & F_K))) ||
        !!(format & F_BITS8) + !!(format & F_BITS6) + !!(format & F_BITS5) > 1 ||
        ((format & F_K) && (K % SUPER || (format & F_FP32))))
        return -2;
#ifndef BLINK_QUANT_ISA
    (void)x; (void)codes; (void)scales; (void)bias; (void)y; (void)threads;
    return -3;
#else
    float *x_sums = NULL, *xf = NULL;
    args_t a = {x, x_stride, (const uint8_t *)codes, (const uint8_t *)scales, bias, y, y_stride, M, N, K, format,
                NULL, NULL, NULL, NULL, NULL};
#ifdef BLINK_QUANT_INT8
    /* x's codes, scales and sums in one block (the rows' quantization split over the threads) */
    /* rows rounded up to a whole block of BLINK_QUANT_INT8_ROWS (the blocked layout) */
    const int64_t sgroups = K / group_size(format),
                  Mb = (M + BLINK_QUANT_INT8_ROWS - 1) / BLINK_QUANT_INT8_ROWS * BLINK_QUANT_INT8_ROWS;
    const size_t sums_bytes = (size_t)(Mb * sgroups) * 4, scale_bytes_ = (size_t)(Mb * (K / GROUP)) * 4;
    char *block = malloc(2 * sums_bytes + scale_bytes_ + (size_t)(Mb * K));
    if (!block) return -4;
    a.x_sums = (float *)block;
    a.xoff = (int32_t *)(block + sums_bytes);
    a.xs = (float *)(block + 2 * sums_bytes);
    a.xq = (int8_t *)(block + 2 * sums_bytes + scale_bytes_);
    int status = blink_run_parts(quantize_rows, &a, M, blink_threads_for(M * K, (int64_t)1 << 15, threads));
    if (status == 0) {
        const int64_t row_passes = (M + BLINK_QUANT_INT8_ROWS - 1) / BLINK_QUANT_INT8_ROWS;
        const int tile_threads = blink_threads_for(row_passes * N * K, BLINK_QUANT_INT8_PER_THREAD, threads);
        status = blink_run_parts_of(run_tiles, &a, N / TILE, tile_threads, tile_parts(N / TILE, tile_threads, row_passes));
    }
    free(block);
    (void)x_sums; (void)xf;
#else
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
    a.x_sums = x_sums;
    a.xf = xf;
    const int status = blink_run_parts_of(run_tiles, &a, N / TILE, threads, tile_parts(N / TILE, threads, passes));
    free(x_sums);
    free(xf);
#endif
    return status;
#endif
}
