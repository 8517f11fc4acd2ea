/* y = x @ W.T (+ bias) for bf16 x and a weight kept as a GGUF file's own 4-bit codes (Q4_0,
 * Q4_1) or 8-bit ones (Q8_0: blink_q8_linear), on CPUs with AMX (Intel Sapphire Rapids and
 * later).
 *
 * Why: a decode step of SmolLM2-135M streams every projection weight once; in bf16 that is
 * ~210 MB, which costs one core here ~23 ms whether the step has 1 or 16 rows. The codes are
 * 4x fewer bytes. torch's int4 CPU kernel reads them too, but its arithmetic grows with the
 * rows (slower than bf16 beyond ~8 rows). Here AMX does the arithmetic, in two ways:
 *
 * - Few rows (a decode batch, <= FEW_ROWS): a group of 32 channels of 16 columns is one tile
 *   product of x with the codes themselves as bf16 (0..15, exact), for up to 16 rows at a
 *   time; Q4's w = d q + m per group then gives x . w = d (x . q) + m sum(x), applied in fp32.
 *   What is left per weight is widening its nibble, the same for 1 row or 16. No weight is
 *   rounded: the result is the product on gguf's fp32 weights, up to fp32 sum order.
 * - Many rows (a prefill): each weight is rebuilt once per panel of rows as fma(q, d, m) in
 *   fp32, gguf's own dequantization, rounded to bf16 (the values of the engine's bf16 copy), and
 *   32 x 32 blocks of the output accumulate plain tile products over K (in slabs that keep
 *   x's rows in L1, the weight tiles streamed past them). Rebuilding costs ~10 instructions
 *   per 32 weights, which hundreds of rows amortise.
 *
 * Layout (made by kernels/cpu/q4_linear.py, `pack`): output columns in tiles of 16, channels
 * in groups of 32. A (tile, group) is one B tile, 16 rows of 32 words, row p holding channels
 * 2p and 2p + 1 of the 16 columns interleaved (word w: column w / 2, channel 2p + w % 2),
 * packed as 4 x 32 16-bit words whose nibble i is row 4c + i's code. Per tile and group, 16
 * fp16 d then 16 fp16 m, one per column.
 *
 * Q8_0 (w = d q, q in -128..127, exact in bf16) takes the same two paths with m = 0: its
 * (tile, group) holds the 16 rows' 32 words as one int8 code each (512 bytes), widened to bf16
 * through fp32 (a split into two 4-bit planes, each widened by one vpermw, measured slower:
 * two products per group). SmolLM2's GGUF stores its tied embedding, the head, as Q8_0: half
 * the bf16 head's bytes per decode step.
 *
 * Gated (blink_q4_linear_gated): for a fused gate/up projection (gate columns [0, N/2), up
 * columns [N/2, N)) the output is the MLP's activation, bf16(bf16(silu(g)) * u) with g and u
 * the bf16 results the plain call would write, so y has N/2 columns and the same bits as the
 * plain call followed by fused.c's SiLU: the products of output tile t and of tile
 * t + N/32 are computed together and combined as they are stored (one pass over the
 * activations fewer, and half the result writes).
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef BLINK_AMX
#include <stdlib.h>

enum { TILE = 16, GROUP = 32, PAIRS = GROUP / 2, MAX_ROWS = 16, STEP = 4 };

/* 16-bit words of codes per (tile, group): 4-bit and 8-bit codes */
enum { WORDS4 = 4 * 32, WORDS8 = PAIRS * 2 * TILE / 2 };

/* Steps of more rows than this rebuild the bf16 weights once and run plain AMX products
 * (run_many_rows); fewer keep the codes as they are (run_few_rows). 8-bit codes cost more to
 * widen, which a second 16-row pass repeats: from 17 rows rebuilding them is faster. */
enum { FEW_ROWS = 32, FEW_ROWS8 = 16 };

/* Column tiles whose rebuilt weights a many-rows step keeps at once (8 x K / 32 KB: 144 KB at
 * K = 576, in L2). */
enum { CHUNK_TILES = 8 };

/* Rows a chunk's rebuilt weights are swept by before the next chunk: the panel's x (512 x K
 * bf16: 576 KB at K = 576) stays in L2 while every chunk meets it. A larger step rebuilds each
 * chunk once per panel: at 2048 rows 1.10-1.14x faster than streaming all of x per chunk. */
enum { PANEL_ROWS = 512 };

/* Rows per thread from which a many-rows call splits its rows rather than its output tiles
 * (quantized_linear). benchmarks/bench_forward.py --before q4-tile-parts builds with
 * -DROWS_PER_THREAD=1073741824: parts of tiles always. */
#ifndef ROWS_PER_THREAD
#define ROWS_PER_THREAD 128
#endif

/* Groups of 32 channels a many-rows block multiplies before its running sums go to memory
 * (4 KB out and back per slab): 32 rows of x over at most 18 groups (36 KB) stay in L1 for
 * every weight tile of a chunk, as K = 1536 (96 KB) would not. K = 576 runs in one slab,
 * K = 1536 in three of 16 (1.09x over one pass; 9-group slabs cost K = 576 1.07-1.10x).
 * benchmarks/bench_forward.py --before q4-one-pass builds with -DSLABS=0: one pass over all
 * of K, the weight tiles loaded like x's (no streaming hint). */
enum { SLAB_GROUPS = 18 };
#ifndef SLABS
#define SLABS 1
#endif
#if SLABS
#define LOAD_WEIGHT_TILE(T, P) _tile_stream_loadd(T, P, 64)
#else
#define LOAD_WEIGHT_TILE(T, P) _tile_loadd(T, P, 64)
#endif

/* How far ahead the codes are prefetched: ~8% faster at 1-16 rows than none (1-2 KB measured
 * best, 8 KB and more no better than none). */
enum { PREFETCH_BYTES = 2048 };

typedef struct {
    const uint16_t *x;       /* [M, K] bf16, rows x_stride apart */
    int64_t x_stride;
    const uint16_t *codes;   /* 4-bit: [N / 16, K / 32, 4, 32] words; 8-bit: [N / 16, K / 32, 16, 32] int8 */
    int bits;                /* 4 or 8 */
    int64_t words;           /* WORDS4 or WORDS8 */
    const uint16_t *scales;  /* [N / 16, K / 32, 2, 16] fp16: d, m */
    const uint16_t *bias;    /* [N] bf16 or NULL */
    uint16_t *y;             /* [M, N] bf16, rows y_stride apart */
    int64_t y_stride;
    int64_t M, N, K;
    const float *x_sums;     /* [M, K / 32]: each row's sum over each group */
    int gated;               /* y = silu(gate) * up, [M, N / 2] (see the top) */
    int by_rows;             /* many rows: a part is 32-row blocks, all tiles (else tiles, all rows) */
} args_t;

/* A (tile, group)'s packed codes -> its B tile, the codes as bf16. Nibble i of word w in
 * chunk c is word w of row 4c + i: shifts, no byte shuffles. */
static inline void unpack_group(const uint16_t *codes, uint16_t *out, __m512i as_bf16) {
    for (int c = 0; c < PAIRS / 4; c++) {
        const __m512i words = _mm512_loadu_si512(codes + c * 32);
        _mm_prefetch((const char *)(codes + c * 32) + PREFETCH_BYTES, _MM_HINT_T0);
        /* vpermw reads an index's low 5 bits: as_bf16 holds bf16(i & 15) at i */
        _mm512_store_si512(out + (4 * c + 0) * 32, _mm512_permutexvar_epi16(words, as_bf16));
        _mm512_store_si512(out + (4 * c + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), as_bf16));
        _mm512_store_si512(out + (4 * c + 2) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), as_bf16));
        _mm512_store_si512(out + (4 * c + 3) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), as_bf16));
    }
}

/* An 8-bit (tile, group)'s 32 codes of B-tile row p -> fp32, words 0-15 and 16-31. */
static inline void codes_row8(const uint16_t *codes, int p, __m512 *lo, __m512 *hi) {
    const int8_t *row = (const int8_t *)codes + p * 2 * TILE;
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + TILE))));
}

/* An 8-bit (tile, group)'s codes -> its B tile, the codes as bf16 (exact). */
static inline void unpack_group8(const uint16_t *codes, uint16_t *out) {
    _mm_prefetch((const char *)codes + PREFETCH_BYTES, _MM_HINT_T0);
    _mm_prefetch((const char *)codes + PREFETCH_BYTES + 256, _MM_HINT_T0);
    for (int p = 0; p < PAIRS; p++) {
        __m512 lo, hi;
        codes_row8(codes, p, &lo, &hi);
        _mm512_store_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Tiles 0-3: four groups' x . q (rows x 16 columns, fp32); 4, 6: x (rows x 32 channels) and
 * 5, 7: codes (16 channel pairs x 16 columns), in turn. */
static void configure(int rows) {
    blink_tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) config.colsb[i] = 64;
    for (int i = 0; i < 4; i++) config.rows[i] = (uint8_t)rows;
    config.rows[4] = config.rows[6] = (uint8_t)rows;
    config.rows[5] = config.rows[7] = PAIRS;
    _tile_loadconfig(&config);
}

/* acc[r] += d (x . q)[r] + m sum(x)[r] for one group. */
static inline void scale_group(const float *dots, const uint16_t *scales, const float *x_sums, int64_t groups,
                               int rows, __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + TILE)));
    for (int r = 0; r < MAX_ROWS; r++) /* a constant bound keeps acc in registers */
        if (r < rows)
            acc[r] = _mm512_fmadd_ps(_mm512_load_ps(dots + r * TILE), d,
                                     _mm512_fmadd_ps(_mm512_set1_ps(x_sums[r * groups]), m, acc[r]));
}

/* Results are rows x 16 fp32, row r at r * TILE: a few-rows pass's accumulators or a block's
 * tile stored by _tile_stored. Both paths write y through the two functions below. */

/* Rows [r0, r0 + rows) of weight tile t's results, plus the bias, to y's tile t in bf16. */
static inline void store_tile(const args_t *a, const float *result, int64_t t, int64_t r0, int rows) {
    const __m512 bias = a->bias ? load_bf16x16(a->bias + t * TILE) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        store_bf16x16(a->y + (r0 + r) * a->y_stride + t * TILE, _mm512_add_ps(_mm512_load_ps(result + r * TILE), bias));
}

/* Gated: rows [r0, r0 + rows) of gate tile t's and up tile t + N/32's results, each plus its
 * bias and rounded to bf16 as store_tile would write it, combined into y's tile t. */
static inline void store_gated(const args_t *a, const float *gate, const float *up, int64_t t, int64_t r0,
                               int rows) {
    const int64_t half = a->N / 2;
    const __m512 bias_g = a->bias ? load_bf16x16(a->bias + t * TILE) : _mm512_setzero_ps();
    const __m512 bias_u = a->bias ? load_bf16x16(a->bias + half + t * TILE) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 g = round_bf16x16(_mm512_add_ps(_mm512_load_ps(gate + r * TILE), bias_g));
        const __m512 u = round_bf16x16(_mm512_add_ps(_mm512_load_ps(up + r * TILE), bias_u));
        store_bf16x16(a->y + (r0 + r) * a->y_stride + t * TILE, silu_times16(g, u));
    }
}

/* Tile registers are named by constants, so the four groups of a step are spelled out. All
 * four are unpacked before the first product, so the unpacking overlaps the tile unit. */
#define UNPACK(J)                                                                               \
    if (J < count) {                                                                            \
        if (a->bits == 8) unpack_group8(codes + (g + J) * a->words, unpacked[J]);               \
        else unpack_group(codes + (g + J) * a->words, unpacked[J], as_bf16);                     \
    }
#define MULTIPLY(J, A, B)                                                                       \
    if (J < count) {                                                                            \
        _tile_loadd(A, x + (g + J) * GROUP, x_bytes);                                           \
        _tile_loadd(B, unpacked[J], 64);                                                        \
        _tile_zero(J);                                                                          \
        _tile_dpbf16ps(J, A, B);                                                                \
    }
#define SCALE(J)                                                                                \
    if (J < count) {                                                                            \
        _tile_stored(J, dots[J], 64);                                                           \
        scale_group(dots[J], scales + (g + J) * 2 * TILE, x_sums + g + J, groups, rows, acc);   \
    }

/* acc[r] = row r0 + r's products with weight tile t (16 columns), rows <= 16. */
static void tile_products(const args_t *a, int64_t t, int64_t r0, int rows, __m512i as_bf16, __m512 *acc) {
    const int64_t groups = a->K / GROUP, x_bytes = a->x_stride * 2;
    const uint16_t *codes = a->codes + t * groups * a->words, *scales = a->scales + t * groups * 2 * TILE;
    const uint16_t *x = a->x + r0 * a->x_stride;
    const float *x_sums = a->x_sums + r0 * groups;
    uint16_t unpacked[STEP][PAIRS * 2 * TILE] __attribute__((aligned(64)));
    float dots[STEP][MAX_ROWS * TILE] __attribute__((aligned(64)));
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += STEP) {
        const int count = (int)(groups - g < STEP ? groups - g : STEP);
        UNPACK(0) UNPACK(1) UNPACK(2) UNPACK(3)
        MULTIPLY(0, 4, 5) MULTIPLY(1, 6, 7) MULTIPLY(2, 4, 5) MULTIPLY(3, 6, 7)
        SCALE(0) SCALE(1) SCALE(2) SCALE(3)
    }
}

/* Output tile t (16 columns of y) for rows [r0, r0 + rows), rows <= 16. */
static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows, __m512i as_bf16) {
    __m512 acc[MAX_ROWS];
    tile_products(a, t, r0, rows, as_bf16, acc);
    if (a->gated) {
        __m512 up[MAX_ROWS];
        tile_products(a, t + a->N / 2 / TILE, r0, rows, as_bf16, up);
        store_gated(a, (const float *)acc, (const float *)up, t, r0, rows);
    } else {
        store_tile(a, (const float *)acc, t, r0, rows);
    }
}

/* ---- Steps of many rows (prefills): each weight rebuilt once per panel, then plain AMX
 * products. Rebuilding costs ~10 instructions per 32 weights, which a prefill's hundreds of rows
 * amortise, and lets each product accumulate over all K in its tile (no per-group scaling). */

/* The 16 per-column fp16 values -> two fp32 vectors in the word order of a B-tile row:
 * lo = columns 0..7 each twice, hi = columns 8..15 each twice. */
static inline void spread(const uint16_t *half16, __m512 *lo, __m512 *hi) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)half16));
    *lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
    *hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

/* A (tile, group)'s codes -> its B tile of bf16 weights: fma(q, d, m) in fp32 is gguf's
 * dequantization (d q exact, one rounding), then rounded to nearest even: the values of the
 * engine's bf16 copy. */
static inline void dequantize_group(const uint16_t *codes, const uint16_t *scales, uint16_t *out) {
    __m512 d_lo, d_hi, m_lo, m_hi;
    spread(scales, &d_lo, &d_hi);
    spread(scales + TILE, &m_lo, &m_hi);
    for (int c = 0; c < PAIRS / 4; c++) {
        const __m512i words = _mm512_loadu_si512(codes + c * 32);
        for (int i = 0; i < 4; i++) {
            const __m512i q = _mm512_and_si512(_mm512_srli_epi16(words, 4 * i), _mm512_set1_epi16(0x0F));
            const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
            const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
            const __m512 w_lo = _mm512_fmadd_ps(q_lo, d_lo, m_lo), w_hi = _mm512_fmadd_ps(q_hi, d_hi, m_hi);
            _mm512_store_si512(out + (4 * c + i) * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
        }
    }
}

/* The 8-bit (tile, group)'s B tile of bf16 weights: d q in fp32 (m is 0), rounded. */
static inline void dequantize_group8(const uint16_t *codes, const uint16_t *scales, uint16_t *out) {
    __m512 d_lo, d_hi, m_lo, m_hi;
    spread(scales, &d_lo, &d_hi);
    spread(scales + TILE, &m_lo, &m_hi);
    for (int p = 0; p < PAIRS; p++) {
        __m512 q_lo, q_hi;
        codes_row8(codes, p, &q_lo, &q_hi);
        const __m512 w_lo = _mm512_fmadd_ps(q_lo, d_lo, m_lo), w_hi = _mm512_fmadd_ps(q_hi, d_hi, m_hi);
        _mm512_store_si512(out + p * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
}

/* Tiles 0-3: results for rows 0-15 / 16-31 x columns 0-15 / 16-31 of a 32 x 32 block (C00,
 * C01, C10, C11); 4, 5: the two row halves of x; 6, 7: the two column halves of W. */
static void configure_block(int rows0, int rows1) {
    blink_tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = config.rows[1] = config.rows[4] = (uint8_t)rows0;
    config.rows[2] = config.rows[3] = config.rows[5] = (uint8_t)rows1;
    config.rows[6] = config.rows[7] = PAIRS;
    for (int i = 0; i < 8; i++) /* a tile of no rows must have no columns either */
        config.colsb[i] = config.rows[i] ? 64 : 0;
    _tile_loadconfig(&config);
}

/* A block's row half, its tiles stored by _tile_stored: first (and, when two, second) to y's
 * tiles t and t + 1, or, gated, y's tile t from first (its gate products) and second (its up
 * products). */
static void store_results(const args_t *a, const float *first, const float *second, int two, int64_t t,
                          int64_t r0, int rows) {
    if (a->gated) {
        store_gated(a, first, second, t, r0, rows);
        return;
    }
    store_tile(a, first, t, r0, rows);
    if (two) store_tile(a, second, t + 1, r0, rows);
}

/* Rows [r0, r0 + rows0 + rows1) x the two weight tiles w[0], w[1] (when two; rebuilt weights
 * w[2][groups][16 x 32]) over groups [g0, g1), with the tiles configured for rows0 and rows1
 * (configure_block). The four result tiles start from zero at g0 = 0 and otherwise from
 * `sums` (fp32, 4 x 16 x 16, the previous slab's); at g1 = groups they are written to y's tiles
 * t and t + 1, or, gated (always two), y's tile t from its gate and up tiles, and otherwise
 * kept in `sums` for the next slab (fp32: the sum order, so the bits, are those of one pass
 * over all K). Weight tiles are loaded with the streaming hint (TILELOADDT1): they pass once
 * per block, while x's slab stays in L1 for every tile of the chunk. */
static void block(const args_t *a, int64_t t, int two, const uint16_t *w, int64_t r0, int rows0, int rows1,
                  int64_t g0, int64_t g1, float *sums) {
    const int64_t groups = a->K / GROUP, x_bytes = a->x_stride * 2, tile_words = PAIRS * 2 * TILE;
    const uint16_t *w1 = w + groups * tile_words;
    const uint16_t *x0 = a->x + r0 * a->x_stride, *x1 = x0 + MAX_ROWS * a->x_stride;
    enum { SUM = MAX_ROWS * TILE }; /* floats per result tile */
    if (g0 == 0) {
        _tile_zero(0);
        if (two) _tile_zero(1);
        if (rows1) {
            _tile_zero(2);
            if (two) _tile_zero(3);
        }
    } else {
        _tile_loadd(0, sums, 64);
        if (two) _tile_loadd(1, sums + SUM, 64);
        if (rows1) {
            _tile_loadd(2, sums + 2 * SUM, 64);
            if (two) _tile_loadd(3, sums + 3 * SUM, 64);
        }
    }
    for (int64_t g = g0; g < g1; g++) {
        _tile_loadd(4, x0 + g * GROUP, x_bytes);
        LOAD_WEIGHT_TILE(6, w + g * tile_words);
        _tile_dpbf16ps(0, 4, 6);
        if (two) { LOAD_WEIGHT_TILE(7, w1 + g * tile_words); _tile_dpbf16ps(1, 4, 7); }
        if (rows1) {
            _tile_loadd(5, x1 + g * GROUP, x_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (g1 < groups) {
        _tile_stored(0, sums, 64);
        if (two) _tile_stored(1, sums + SUM, 64);
        if (rows1) {
            _tile_stored(2, sums + 2 * SUM, 64);
            if (two) _tile_stored(3, sums + 3 * SUM, 64);
        }
        return;
    }
    float result[2][SUM] __attribute__((aligned(64))); /* one row half at a time: stays in L1 */
    _tile_stored(0, result[0], 64);
    if (two) _tile_stored(1, result[1], 64);
    store_results(a, result[0], result[1], two, t, r0, rows0);
    if (rows1) {
        _tile_stored(2, result[0], 64);
        if (two) _tile_stored(3, result[1], 64);
        store_results(a, result[0], result[1], two, t, r0 + MAX_ROWS, rows1);
    }
}

/* Chunk [t0, t1)'s output tiles' weights rebuilt into w (gated: each output tile's gate and
 * up weight tiles side by side). */
static void rebuild_chunk(const args_t *a, int64_t t0, int64_t t1, uint16_t *w) {
    const int64_t groups = a->K / GROUP, tile_words = PAIRS * 2 * TILE, up_tiles = a->N / 2 / TILE;
    const int64_t rebuilt = a->gated ? 2 * (t1 - t0) : t1 - t0;
    for (int64_t i = 0; i < rebuilt; i++) {
        const int64_t t = a->gated ? t0 + i / 2 + (i % 2) * up_tiles : t0 + i; /* weight tile */
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *codes = a->codes + (t * groups + g) * a->words;
            const uint16_t *scales = a->scales + (t * groups + g) * 2 * TILE;
            uint16_t *out = w + (i * groups + g) * tile_words;
            if (a->bits == 8) dequantize_group8(codes, scales, out);
            else dequantize_group(codes, scales, out);
        }
    }
}

/* Rows [p0, p1) x chunk [t0, t1)'s rebuilt weights w, in 32-row blocks, each over K in slabs
 * of at most SLAB_GROUPS groups (the block's running sums kept in `sums`, 4 tiles per pair of
 * weight tiles); `configured` holds the tile configuration's two row counts (reloaded only
 * when they change). */
static void sweep_chunk(const args_t *a, int64_t t0, int64_t t1, const uint16_t *w, int64_t p0, int64_t p1,
                        int configured[2], float *sums) {
    const int64_t groups = a->K / GROUP, tile_words = PAIRS * 2 * TILE, sum_floats = 4 * MAX_ROWS * TILE;
    const int64_t slabs = SLABS ? (groups + SLAB_GROUPS - 1) / SLAB_GROUPS : 1;
    const int64_t per_slab = (groups + slabs - 1) / slabs;
    for (int64_t r0 = p0; r0 < p1; r0 += 2 * MAX_ROWS) {
        const int64_t left = p1 - r0;
        const int rows0 = (int)(left < MAX_ROWS ? left : MAX_ROWS);
        const int rows1 = (int)(left <= MAX_ROWS ? 0 : left - MAX_ROWS < MAX_ROWS ? left - MAX_ROWS : MAX_ROWS);
        if (rows0 != configured[0] || rows1 != configured[1]) {
            configure_block(rows0, rows1);
            configured[0] = rows0, configured[1] = rows1;
        }
        for (int64_t g0 = 0; g0 < groups; g0 += per_slab) {
            const int64_t g1 = groups - g0 < per_slab ? groups : g0 + per_slab;
            if (a->gated)
                for (int64_t t = t0; t < t1; t++)
                    block(a, t, 1, w + 2 * (t - t0) * groups * tile_words, r0, rows0, rows1, g0, g1,
                          sums + (t - t0) * sum_floats);
            else
                for (int64_t t = t0; t < t1; t += 2)
                    block(a, t, t + 1 < t1, w + (t - t0) * groups * tile_words, r0, rows0, rows1, g0, g1,
                          sums + (t - t0) / 2 * sum_floats);
        }
    }
}

/* Per panel of PANEL_ROWS rows, output tiles in chunks of CHUNK_TILES weight tiles, each
 * chunk's weights rebuilt (into L2) and then swept by 32-row blocks whose x slab (32 x 576
 * channels at most) stays in L1 while it meets every tile of the chunk. Gated, a chunk holds
 * half as many output tiles, each one's gate and up tiles side by side. A part is a range of
 * 32-row blocks with every tile (by_rows) or a range of tiles with every row. */
static void *run_many_rows(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    const int64_t groups = a->K / GROUP, tile_words = PAIRS * 2 * TILE;
    const int64_t per_chunk = a->gated ? CHUNK_TILES / 2 : CHUNK_TILES; /* output tiles */
    uint16_t *w = aligned_alloc(64, (size_t)(CHUNK_TILES * groups * tile_words) * sizeof *w);
    /* a block's 4 result tiles per pair of weight tiles in the chunk */
    float *sums = aligned_alloc(64, (size_t)(CHUNK_TILES / 2 * 4 * MAX_ROWS * TILE) * sizeof *sums);
    if (!w || !sums) {
        free(w);
        free(sums);
        p->status = -4;
        return NULL;
    }
    int configured[2] = {-1, -1};
    const int64_t out_tiles = a->gated ? a->N / 2 / TILE : a->N / TILE, block_rows = 2 * MAX_ROWS;
    const int64_t r_lo = a->by_rows ? p->lo * block_rows : 0;
    const int64_t r_hi = !a->by_rows || p->hi * block_rows > a->M ? a->M : p->hi * block_rows;
    const int64_t t_lo = a->by_rows ? 0 : p->lo, t_hi = a->by_rows ? out_tiles : p->hi;
    for (int64_t p0 = r_lo; p0 < r_hi; p0 += PANEL_ROWS) {
        const int64_t p1 = r_hi - p0 < PANEL_ROWS ? r_hi : p0 + PANEL_ROWS;
        for (int64_t t0 = t_lo; t0 < t_hi; t0 += per_chunk) {
            const int64_t t1 = t_hi - t0 < per_chunk ? t_hi : t0 + per_chunk;
            rebuild_chunk(a, t0, t1, w);
            sweep_chunk(a, t0, t1, w, p0, p1, configured, sums);
        }
    }
    _tile_release();
    free(w);
    free(sums);
    return NULL;
}

static void *run_few_rows(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    __m512i as_bf16;
    for (int i = 0; i < 32; i++) { /* bf16 of i & 15: the top half of the fp32's bits */
        const float f = (float)(i & 15);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        ((uint16_t *)&as_bf16)[i] = (uint16_t)(bits >> 16);
    }
    for (int64_t r0 = 0; r0 < a->M; r0 += MAX_ROWS) {
        const int rows = (int)(a->M - r0 < MAX_ROWS ? a->M - r0 : MAX_ROWS);
        configure(rows);
        for (int64_t t = p->lo; t < p->hi; t++) tile_pass(a, t, r0, rows, as_bf16);
    }
    _tile_release(); /* tile state left loaded would cost every context switch an 8 KB save */
    return NULL;
}

/* Each row's fp32 sum over each group of 32 channels. */
static void group_sums(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < K / GROUP; g++) {
            const __m512i words = _mm512_loadu_si512(x + r * x_stride + g * GROUP);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32((int)0xFFFF0000u)));
            out[r * (K / GROUP) + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

/* The row count above which a step takes the many-rows path (kernels/cpu/q4_linear.py reads it). */
int blink_q4_linear_few_rows(void) { return FEW_ROWS; }

/* 1 where this process may use AMX (asked of the kernel once; Linux 5.16 and later). */
int blink_q4_linear_supported(void) { return blink_amx_granted(); }

/* Returns 0; -2 for shapes this kernel does not take (the caller checks them first); -3
 * where AMX is not granted; -4 out of memory. `threads` split the column tiles when the
 * product is large enough to pay for them. */
static int quantized_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, int bits,
                            const uint16_t *scales, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                            int64_t M, int64_t N, int64_t K, int gated, int threads) {
    const int64_t out_tiles = gated ? N / 2 / TILE : N / TILE;
    if (M < 1 || N % (gated ? 2 * TILE : TILE) || K % GROUP || x_stride < K || y_stride < out_tiles * TILE)
        return -2;
    if (!blink_q4_linear_supported()) return -3;
    const int many = M > (bits == 8 ? FEW_ROWS8 : FEW_ROWS);
    float *x_sums = NULL;
    if (!many) { /* the few-rows path applies m through each row's group sums */
        x_sums = malloc((size_t)(M * (K / GROUP)) * sizeof *x_sums);
        if (!x_sums) return -4;
        group_sums(x, x_stride, M, K, x_sums);
    }
    /* one thread per ~5-10 us of work at most (64K weights to unpack for a few rows, 1M
     * multiply-adds for many): a decode step's projections split too, and a worker that is
     * not running leaves its part to this thread (pool.c) */
    threads = blink_threads_for(many ? M * N * K >> 4 : N * K, (int64_t)1 << 16, threads);
    /* Many rows, at least ROWS_PER_THREAD per thread: parts of rows, so that each thread
     * reads the rows of x that the op before (split by rows too) left in its own cache and
     * writes the rows of y the op after reads there, at the cost of rebuilding every weight
     * in each part (the same total from 2 panels per thread on). The whole 16 x 128 prefill
     * 1.17x, 4 x 128 1.15x; below 256 rows on 2 threads, parts of tiles were faster. */
    const int by_rows = many && M >= (int64_t)threads * ROWS_PER_THREAD;
    args_t a = {x, x_stride, codes, bits, bits == 8 ? WORDS8 : WORDS4, scales, bias, y, y_stride, M, N, K, x_sums,
                gated, by_rows};
    const int status = blink_run_parts(many ? run_many_rows : run_few_rows, &a,
                                       by_rows ? (M + 2 * MAX_ROWS - 1) / (2 * MAX_ROWS) : out_tiles, threads);
    free(x_sums);
    return status;
}

/* 4-bit codes (Q4_0, Q4_1); see quantized_linear. */
int blink_q4_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    return quantized_linear(x, x_stride, codes, 4, scales, bias, y, y_stride, M, N, K, 0, threads);
}

/* 4-bit codes of a fused gate/up projection [N, K] -> y = silu(gate) * up, [M, N / 2] (see the
 * top); see quantized_linear. */
int blink_q4_linear_gated(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                          const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                          int threads) {
    return quantized_linear(x, x_stride, codes, 4, scales, bias, y, y_stride, M, N, K, 1, threads);
}

/* 8-bit codes (Q8_0); see quantized_linear. */
int blink_q8_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    return quantized_linear(x, x_stride, codes, 8, scales, bias, y, y_stride, M, N, K, 0, threads);
}

#else /* no AMX in this build: the Python side keeps its other paths */

int blink_q4_linear_supported(void) { return 0; }

int blink_q4_linear_few_rows(void) { return 0; }

int blink_q4_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    (void)x; (void)x_stride; (void)codes; (void)scales; (void)bias; (void)y; (void)y_stride;
    (void)M; (void)N; (void)K; (void)threads;
    return -2;
}

int blink_q8_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    return blink_q4_linear(x, x_stride, codes, scales, bias, y, y_stride, M, N, K, threads);
}

int blink_q4_linear_gated(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                          const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                          int threads) {
    return blink_q4_linear(x, x_stride, codes, scales, bias, y, y_stride, M, N, K, threads);
}

#endif
