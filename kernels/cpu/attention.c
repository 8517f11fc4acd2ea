/* Paged attention for the eager CPU forward, reading K/V where they lie in the paged cache.
 *
 * The torch path (kernels/cpu/attention.py) gathers every query tile's context with
 * index_select, lays the queries out in tiles and runs SDPA, about ten aten ops and two
 * copies of the context per layer. For a decode step the compute is tiny (16 rows x 9 heads
 * x a few hundred keys), so those copies and per-op costs were ~25% of a 16-row SmolLM2 step.
 * Here each (token, KV head) pair is one online-softmax pass over its sequence's blocks,
 * the G query heads that share the KV head together, so each K/V element is read once per
 * token, in the cache's dtype, and never copied.
 *
 * Semantics are the reference's (kernels/reference/layers.py paged_attention): token t of row r
 * (t inside r's span of query_start_loc) attends to positions j <= min(positions[t],
 * seq_lens[r] - 1); every other token (bucket padding, unused rows) gets zeros. Accumulation
 * is fp32 whatever the dtypes. Built at first use by kernels/cpu/attention.py, with GCC >= 12
 * or clang (reduce_lanes' __builtin_shufflevector; an older GCC stops at an #error there).
 *
 * Prompt rows (at least TILE_MIN_TOKENS new tokens): the per-token pass reads the whole
 * context once per token and does its products one key at a time (~65 ms of a 512-token
 * SmolLM2 chunk). Those rows take tiles instead: the row's K and V are laid out once per
 * (row, KV head), then each tile of 16 queries per head is a flash-attention pass over
 * chunks of keys with the scores transposed (keys x queries, one query a lane: the online
 * softmax needs no horizontal reductions). Two kinds:
 * - AMX (bf16 queries and cache, a CPU with AMX): K and V in AMX's pair-interleaved layout,
 *   32-key chunks, scores by one AMX product, the softmax on AVX-512 in fp32, probabilities
 *   rounded to bf16 (as GPU flash attention does) for the AMX product with V, accumulated in
 *   fp32.
 * - AVX-512 (every other AVX-512 build or call): K and V as fp32 rows, 16-key chunks, both
 *   products as FMAs of a broadcast element with 16 queries' lane, all in fp32 (1.8-3.8x the
 *   per-token pass and 2.3-10x SDPA at 16-2048 new tokens on Zen 4).
 *
 * Decode rows (the per-token pass) on AMX too, for their scores only: per 16 keys one tile of
 * K rows, read where they lie (the cache's slot stride as the tile's row stride), times the
 * G query heads' pairs laid out once per (token, KV head); the softmax and the product with V
 * stay on AVX-512 (V would need its key pairs interleaved first). 1.13-1.16x the attention of
 * a 16 x 192 decode step over 30 layers' caches (docs/performance.md#cpu-attention).
 *
 * Decode rows over a bf16 cache in AVX-512 and AVX2 builds without AMX scores
 * (attend_in_chunks): each token's keys in chunks of ~128, a unit of work per chunk for its
 * heads, scores by vdpbf16ps where the CPU has AVX512_BF16 (else FMAs), the chunks' softmax
 * states merged; 1.2-2.5x the per-token pass per layer on Zen 4, 1.2-1.4x built for AVX2
 * (docs/performance.md#decode-attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* benchmarks/bench_forward.py --before attention-no-tiles builds with -DTILES=0 (the prompt
 * rows' tiles); -DSCORE_TILES=0 keeps the per-token pass's scores on AVX-512 */
#ifndef TILES
#define TILES 1
#endif
#ifndef SCORE_TILES
#define SCORE_TILES 1
#endif
#if !defined(BLINK_AMX)
#undef SCORE_TILES
#define SCORE_TILES 0
#endif

/* benchmarks/bench_forward.py --before attention-generic-decode builds with -DDECODE_CASES=0:
 * the per-token pass with its group size read at run time and without the bf16 chunks
 * (attend_in_chunks), as before them */
#ifndef DECODE_CASES
#define DECODE_CASES 1
#endif

/* benchmarks/bench_forward.py --before attention-no-prefetch builds with -DPREFETCH=0 */
#ifndef PREFETCH
#define PREFETCH 1
#endif

/* -DVALUES_PREFETCH=0: the chunks' values pass without its prefetches (attend_chunk_as: a key's
 * rows of the unit's other KV heads, and the unit's rows of the key a block ahead;
 * benchmarks/bench_cpu_attention.py --cold --against VALUES_PREFETCH=0) */
#ifndef VALUES_PREFETCH
#define VALUES_PREFETCH PREFETCH
#endif

/* Limits of the per-call stack arrays; kernels/cpu/attention.py sends larger shapes to the
 * torch path. */
enum { MAX_GROUP = 16, MAX_HEAD_DIM = 256, MAX_BLOCK = 128 };

typedef struct {
    const void *q;        /* [T, H, D], rows strided: element (t, h, d) at t*q_stride_t + h*q_stride_h + d */
    int64_t q_stride_t, q_stride_h;
    void *out;            /* [T, H, D], q's dtype */
    const void *k, *v;    /* [num_blocks, block_size, KVH, D] */
    int q_bf16, kv_bf16;
    int64_t T, H, KVH, D, block_size, num_blocks, rows;
    const int64_t *token_row, *positions; /* [T] */
    const int32_t *query_start, *seq_lens; /* [rows + 1], [rows] */
    const int32_t *tables;                 /* [rows, table_stride] */
    int64_t table_stride, table_cols;      /* table_cols: usable columns */
    float scale;
    int score_tiles; /* the per-token pass's scores on AMX (see attend_as) */
} args_t;

/* Whether this process lets the kernel use AMX where the build and the OS have it: 0 under
 * $BLINK_CPU_AMX=0 (kernels/cpu/attention.py), which makes a CPU with AMX take the path a CPU
 * without it takes: every row on the per-token pass, its scores on AVX-512, no tiles. */
static int amx_allowed = 1;
void blink_paged_attention_allow_amx(int allowed) { amx_allowed = allowed != 0; }


/* W floats, one register: 16 with AVX-512, else 8 (an AVX2 register). With 16-float vectors an
 * AVX2 build took two registers a vector, and the scores of W keys for a group of heads spilled
 * from its 16: 5.4x the AVX-512 build's time a key at 16 rows over 2048 keys, 1.36x with 8
 * (docs/performance.md#avx2-cpus). The compiler lowers them for the host. */
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu32 __attribute__((vector_size(4 * W)));
typedef uint16_t vu16 __attribute__((vector_size(2 * W)));

static inline vf load_vec(const void *base, int64_t index, int bf16) {
    vf f;
    if (bf16) { /* bf16 is the top half of an fp32 */
        vu16 h;
        memcpy(&h, (const uint16_t *)base + index, sizeof h);
        vu32 u = __builtin_convertvector(h, vu32) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)base + index, sizeof f);
    }
    return f;
}

static inline void store_vec(void *base, int64_t index, vf f, int bf16) {
    if (bf16) { /* round to nearest even; attention outputs are finite */
        vu32 u;
        memcpy(&u, &f, sizeof u);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        vu16 h = __builtin_convertvector(u, vu16);
        memcpy((uint16_t *)base + index, &h, sizeof h);
    } else {
        memcpy((float *)base + index, &f, sizeof f);
    }
}

/* r[j] = sum of v[j]'s lanes, j < W: log2(W) levels of pairwise shuffles and adds (W - 1 adds
 * for W keys instead of a horizontal sum per key). Each level halves every vector's partial
 * sums and packs two vectors into one, keeping the keys in order.
 * __builtin_shufflevector: GCC >= 12 or clang. An older GCC stops here with the message
 * below; the Python side then warns (naming the requirement and the compiler found) and
 * runs the torch path. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
#error "kernels/cpu/attention.c needs GCC >= 12 or clang (__builtin_shufflevector)"
#endif
#define PAIR(x, y, LO, HI) (__builtin_shufflevector(x, y, LO) + __builtin_shufflevector(x, y, HI))
#if W == 16
static inline vf reduce_lanes(vf v[W]) {
#define LO1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
    vf a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = PAIR(v[2 * j], v[2 * j + 1], LO1, HI1);
    for (int j = 0; j < 4; j++) b[j] = PAIR(a[2 * j], a[2 * j + 1], LO2, HI2);
    for (int j = 0; j < 2; j++) c[j] = PAIR(b[2 * j], b[2 * j + 1], LO3, HI3);
    return PAIR(c[0], c[1], LO4, HI4);
}
#else
static inline vf reduce_lanes(vf v[W]) {
#define LO1 0, 1, 2, 3, 8, 9, 10, 11
#define HI1 4, 5, 6, 7, 12, 13, 14, 15
#define LO2 0, 1, 4, 5, 8, 9, 12, 13
#define HI2 2, 3, 6, 7, 10, 11, 14, 15
#define LO3 0, 2, 4, 6, 8, 10, 12, 14
#define HI3 1, 3, 5, 7, 9, 11, 13, 15
    vf a[4], b[2];
    for (int j = 0; j < 4; j++) a[j] = PAIR(v[2 * j], v[2 * j + 1], LO1, HI1);
    for (int j = 0; j < 2; j++) b[j] = PAIR(a[2 * j], a[2 * j + 1], LO2, HI2);
    return PAIR(b[0], b[1], LO3, HI3);
}
#endif
#undef PAIR

/* One block's step of the online softmax for one head: s[0, nk) (the block's scores; the
 * array has room for whole 16-lane chunks) becomes e^(s - new max), the running max m and
 * sum l move on, and the factor for what was accumulated before is returned. On AVX-512, 16
 * keys per exp (a scalar exp per key was ~40% of a 16-row decode step's attention). */
#if defined(__AVX512F__)
static inline float softmax_block(float *s, int64_t nk, float *m, float *l) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 top = minus_inf;
    for (int64_t c0 = 0; c0 < nk; c0 += W) {
        const __mmask16 live = nk - c0 >= W ? (__mmask16)0xFFFF : (__mmask16)((1u << (nk - c0)) - 1u);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(minus_inf, live, s + c0));
    }
    const float block_max = _mm512_reduce_max_ps(top);
    const float new_max = *m > block_max ? *m : block_max;
    const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - new_max);
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nk; c0 += W) {
        const __mmask16 live = nk - c0 >= W ? (__mmask16)0xFFFF : (__mmask16)((1u << (nk - c0)) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + c0), shift)));
        _mm512_storeu_ps(s + c0, p);
        sum = _mm512_add_ps(sum, p);
    }
    *l = *l * correction + _mm512_reduce_add_ps(sum);
    *m = new_max;
    return correction;
}
#else
static inline float softmax_block(float *s, int64_t nk, float *m, float *l) {
    float block_max = s[0];
    for (int64_t jj = 1; jj < nk; jj++) block_max = s[jj] > block_max ? s[jj] : block_max;
    const float new_max = *m > block_max ? *m : block_max;
    const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - new_max);
    float sum = 0.0f;
    int64_t jj = 0;
#if defined(BLINK_AVX2_EXP) /* 8 keys per exp (a scalar exp per key made the AVX2 build 2-9x slower than SDPA) */
    const __m256 shift = _mm256_set1_ps(new_max);
    __m256 sums = _mm256_setzero_ps();
    for (; jj + 8 <= nk; jj += 8) {
        const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + jj), shift));
        _mm256_storeu_ps(s + jj, p);
        sums = _mm256_add_ps(sums, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; jj < nk; jj++) {
        s[jj] = exp_nonpositive(s[jj] - new_max);
        sum += s[jj];
    }
    *l = *l * correction + sum;
    *m = new_max;
    return correction;
}
#endif

#if SCORE_TILES
/* Decode scores on AMX (attend_as): tile 0 the scores (16 keys x G heads, fp32), 1 a tile of
 * 16 keys' K rows (32 channels), 2..7 the queries' pairs, 32 channels each: heads of up to
 * 192 channels. Tile registers are named by constants, hence the spelled-out steps. */
enum { MAX_SCORE_TILES = 6 };
#define LOAD_Q_PAIRS(C, TILE)                                                                   \
    if ((C) < D / 32) _tile_loadd(TILE, q_pairs[C], 64);
#define SCORE_PRODUCT(C, TILE)                                                                  \
    if ((C) < D / 32) {                                                                         \
        _tile_loadd(1, keys + 32 * (C), key_stride * 2);                                        \
        _tile_dpbf16ps(0, 1, TILE);                                                             \
    }

static void configure_score_tiles(int64_t G) {
    blink_tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.rows[i] = 16;
        config.colsb[i] = i == 1 ? 64 : (uint16_t)(4 * G);
    }
    _tile_loadconfig(&config);
}

/* Whether the per-token pass takes the AMX scores: bf16 queries and cache, whole 32-channel
 * tiles of at most 192 channels, blocks of whole 16-key tiles (a tile never reads past its
 * block), and AMX granted and allowed. */
static int takes_score_tiles(const args_t *a) {
    return a->q_bf16 && a->kv_bf16 && a->D % 32 == 0 && a->D / 32 <= MAX_SCORE_TILES && a->block_size % 16 == 0
           && amx_allowed && blink_amx_granted();
}
#endif

/* The keys token t sees (0: padding or a token of no live row) and its row (*row). */
static inline int64_t visible_keys(const args_t *a, int64_t t, int64_t *row) {
    const int64_t r = a->token_row[t];
    *row = r;
    if (r < 0 || r >= a->rows || a->seq_lens[r] <= 0 || t < a->query_start[r] || t >= a->query_start[r + 1])
        return 0;
    int64_t limit = a->positions[t];
    if (limit > a->seq_lens[r] - 1) limit = a->seq_lens[r] - 1;
    return limit + 1 < a->table_cols * a->block_size ? limit + 1 : a->table_cols * a->block_size;
}

/* One (token, KV head): returns 0, or -1 when a block id is outside the cache. Inlined with
 * constant `kv_bf16`, `NV` (16-float vectors per head) and, for the usual group sizes, `GC`
 * (query heads per KV head; 0: read from the shapes) by attend() below, so that the inner
 * loops have neither a dtype branch nor a loop count to read and the queries and
 * accumulators can live in registers (1.2-1.3x the per-token pass on Zen 4 with G constant;
 * docs/performance.md#decode-attention). */
static inline __attribute__((always_inline)) int attend_as(const args_t *a, int64_t t, int64_t g,
                                                             const int kv_bf16, const int64_t NV, const int64_t GC) {
    const int64_t D = NV * W, G = GC > 0 ? GC : a->H / a->KVH, BS = a->block_size;
    const int64_t out_base = (t * a->H + g * G) * D;
    int64_t row;
    const int64_t n_keys = visible_keys(a, t, &row);
    if (n_keys <= 0) { /* padding or an unused row: zeros, as the reference gives */
        size_t bytes = (size_t)(G * D) * (a->q_bf16 ? 2 : 4);
        memset((char *)a->out + out_base * (a->q_bf16 ? 2 : 4), 0, bytes);
        return 0;
    }

    vf q[MAX_GROUP][MAX_HEAD_DIM / W], acc[MAX_GROUP][MAX_HEAD_DIM / W], key[MAX_HEAD_DIM / W];
    vf dots[MAX_GROUP][W];
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK + W];
    const vf zero = {0};
    for (int64_t i = 0; i < G; i++) {
        for (int64_t n = 0; n < NV; n++) {
            q[i][n] = load_vec(a->q, t * a->q_stride_t + (g * G + i) * a->q_stride_h + n * W, a->q_bf16) * a->scale;
            acc[i][n] = zero;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t key_stride = a->KVH * D; /* elements between consecutive slots */
    const int64_t elem = kv_bf16 ? 2 : 4;
#if SCORE_TILES
    /* Scores on AMX: per 16 keys (one tile of K rows read where they lie, the slot stride as
     * the row stride) times the G queries as pairs, B tile c holding channels 32c..32c+31:
     * B[p][2n + i] = q[head n][32c + 2p + i] in the cache's bf16, scaled after the product. */
    uint16_t q_pairs[MAX_SCORE_TILES][W][2 * W] __attribute__((aligned(64)));
    if (a->score_tiles) {
        const uint16_t *qh = (const uint16_t *)a->q + t * a->q_stride_t + g * G * a->q_stride_h;
        memset(q_pairs, 0, (size_t)(D / 32) * sizeof q_pairs[0]);
        for (int64_t c = 0; c < D / 32; c++)
            for (int64_t pr = 0; pr < W; pr++)
                for (int64_t n = 0; n < G; n++) {
                    q_pairs[c][pr][2 * n] = qh[n * a->q_stride_h + 32 * c + 2 * pr];
                    q_pairs[c][pr][2 * n + 1] = qh[n * a->q_stride_h + 32 * c + 2 * pr + 1];
                }
        LOAD_Q_PAIRS(0, 2) LOAD_Q_PAIRS(1, 3) LOAD_Q_PAIRS(2, 4) LOAD_Q_PAIRS(3, 5) LOAD_Q_PAIRS(4, 6)
        LOAD_Q_PAIRS(5, 7)
    }
#endif
    const int32_t *table = a->tables + row * a->table_stride;
    for (int64_t j0 = 0; j0 < n_keys; j0 += BS) {
        int64_t block = table[j0 / BS];
        if (block < 0 || block >= a->num_blocks) return -1;
        int64_t nk = n_keys - j0 < BS ? n_keys - j0 : BS;
        int64_t first = (block * BS * a->KVH + g) * D;
        if (PREFETCH && j0 + BS < n_keys) { /* the next block's rows of this head, while this
                                             * one computes: blocks lie anywhere, so the hardware
                                             * prefetcher cannot guess (1.10-1.14x the 16-row
                                             * decode step at 128-256 cached tokens) */
            int64_t next = table[j0 / BS + 1];
            if (next >= 0 && next < a->num_blocks)
                for (int64_t jj = 0; jj < BS; jj++) {
                    int64_t at = (next * BS * a->KVH + g) * D + jj * key_stride;
                    for (int64_t byte = 0; byte < D * elem; byte += 64) {
                        __builtin_prefetch((const char *)a->k + at * elem + byte);
                        __builtin_prefetch((const char *)a->v + at * elem + byte);
                    }
                }
        }
#if SCORE_TILES
        if (a->score_tiles) { /* scores, 16 keys at a time, by AMX products (see above) */
            for (int64_t c0 = 0; c0 < nk; c0 += W) {
                float scores[W][W] __attribute__((aligned(64))); /* [key][head] */
                const uint16_t *keys = (const uint16_t *)a->k + first + c0 * key_stride;
                _tile_zero(0);
                SCORE_PRODUCT(0, 2) SCORE_PRODUCT(1, 3) SCORE_PRODUCT(2, 4) SCORE_PRODUCT(3, 5)
                SCORE_PRODUCT(4, 6) SCORE_PRODUCT(5, 7)
                _tile_stored(0, scores, 64);
                const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                          _mm512_set1_epi32(W));
                for (int64_t i = 0; i < G; i++) /* head i's column: its 16 keys' scores */
                    _mm512_storeu_ps(&s[i][c0], _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)i)),
                                                                                  &scores[0][0], 4),
                                                              _mm512_set1_ps(a->scale)));
            }
        } else
#endif
        for (int64_t c0 = 0; c0 < nk; c0 += W) { /* scores, W keys at a time */
            int64_t nc = nk - c0 < W ? nk - c0 : W;
            for (int64_t jj = 0; jj < W; jj++) {
                if (jj < nc) {
                    for (int64_t n = 0; n < NV; n++)
                        key[n] = load_vec(a->k, first + (c0 + jj) * key_stride + n * W, kv_bf16);
                } else {
                    for (int64_t n = 0; n < NV; n++) key[n] = zero;
                }
                for (int64_t i = 0; i < G; i++) {
                    vf dot = q[i][0] * key[0];
                    for (int64_t n = 1; n < NV; n++) dot += q[i][n] * key[n];
                    dots[i][jj] = dot;
                }
            }
            for (int64_t i = 0; i < G; i++) {
                vf sums = reduce_lanes(dots[i]);
                memcpy(&s[i][c0], &sums, sizeof sums);
            }
        }
        for (int64_t i = 0; i < G; i++) { /* online softmax: rescale what came before */
            const float correction = softmax_block(s[i], nk, &m[i], &l[i]);
            for (int64_t n = 0; n < NV; n++) acc[i][n] *= correction;
        }
        for (int64_t jj = 0; jj < nk; jj++) { /* weighted values */
            for (int64_t n = 0; n < NV; n++) key[n] = load_vec(a->v, first + jj * key_stride + n * W, kv_bf16);
            for (int64_t i = 0; i < G; i++) {
                float p = s[i][jj];
                for (int64_t n = 0; n < NV; n++) acc[i][n] += p * key[n];
            }
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float inv = 1.0f / l[i];
        for (int64_t n = 0; n < NV; n++) store_vec(a->out, out_base + i * D + n * W, acc[i][n] * inv, a->q_bf16);
    }
    return 0;
}

#if (W == 16 || (defined(__AVX2__) && defined(__FMA__))) && DECODE_CASES
#define CHUNKED_DECODE 1
/* The per-token pass for bf16 queries over a bf16 cache in AVX-512 and AVX2 builds (but under
 * AMX scores), in units of one token's chunk of keys for all its heads. A token's keys are cut
 * into chunks of about DECODE_CHUNK_KEYS (whole blocks, chunk_keys) by its own context length
 * only, so its bits never depend on the rows beside it or the thread count; a token of several
 * chunks gets each chunk's softmax state (max, sum, weighted values) and a merge. Against
 * attend_as:
 * - units of (token, chunk, all its KV heads or two of 4+: unit_kv_heads) instead of (token, KV
 *   head): a one-row decode step of SmolLM2 (3 KV heads) split 2:1 over two threads; now a long
 *   context splits evenly, and a row's short context too from 65 keys (chunk_keys: an even
 *   count; chunks of 256 measured no different);
 * - with AVX512_BF16, scores by vdpbf16ps on the raw bf16 pairs: K is not widened, and a key
 *   costs NL instructions a head instead of 2 NL conversions plus 2 NL FMAs; the products are
 *   exact in fp32 (bf16 x bf16), summed in fp32 in another order than attend_as', then scaled.
 *   Without it (Ice Lake, Skylake-X, AVX2 CPUs), K widened as V is below and 2 NL FMAs a head,
 *   q widened the same way once per block;
 * - each key's W partial sums reduced with in-lane shuffles first (4 keys to one lane each per
 *   128-bit block), then across blocks once per W keys;
 * - the softmax once a chunk instead of once a block (16 keys);
 * - V widened by interleaving zeros below its bf16 (one vpunpck a W-channel vector): the
 *   weighted values hold channels in that interleave's order, and the final vpackusdw of the
 *   rounded halves restores it.
 * docs/performance.md#decode-attention has the measurements. */
#ifndef DECODE_CHUNK_KEYS
#define DECODE_CHUNK_KEYS 128
#endif

enum { DECODE_CHUNK = 2 * DECODE_CHUNK_KEYS }; /* the most keys a chunk can have (below) */

/* The few operations the chunks take, on W-float vectors: a load of 2W bf16 (a "part"), widened
 * to two vectors in the interleave's order (lanes 0-3 of each 128-bit block from the first
 * half of that block's 8 bf16, lanes 4-7... as vpunpck*wd lays them out). */
#if W == 16
typedef __m512 cvec;
typedef __m512i cvec_i;
#define CV_ZERO_I() _mm512_setzero_si512()
#define CV_LOAD_I(p) _mm512_loadu_si512(p)
#define CV_WIDEN_LO(x) _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x))
#define CV_WIDEN_HI(x) _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x))
#define CV_ZERO() _mm512_setzero_ps()
#define CV_SET1(f) _mm512_set1_ps(f)
#define CV_LOAD(p) _mm512_loadu_ps(p)
#define CV_STORE(p, v) _mm512_storeu_ps(p, v)
#define CV_ADD(x, y) _mm512_add_ps(x, y)
#define CV_MUL(x, y) _mm512_mul_ps(x, y)
#define CV_FMA(x, y, z) _mm512_fmadd_ps(x, y, z)
#define CV_UNPACKLO(x, y) _mm512_unpacklo_ps(x, y)
#define CV_UNPACKHI(x, y) _mm512_unpackhi_ps(x, y)
#define CV_SHUFFLE(x, y, imm) _mm512_shuffle_ps(x, y, imm)
/* W keys' sums from their quads (quads[k]: keys 4k..4k+3, one lane each per 128-bit block) */
static inline cvec sum_quads(const cvec quads[4]) {
    const cvec lo = CV_ADD(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const cvec hi = CV_ADD(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return CV_ADD(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* a part's two vectors (scaled by inv) rounded to bf16 (nearest even, as store_vec) in channel order */
static inline void store_part_bf16(uint16_t *out, cvec lo, cvec hi, cvec inv) {
    const __m512i half_ulp = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    const __m512i u = _mm512_castps_si512(CV_MUL(lo, inv)), v = _mm512_castps_si512(CV_MUL(hi, inv));
    const __m512i ru = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half_ulp), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
    const __m512i rv = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, half_ulp), _mm512_and_si512(_mm512_srli_epi32(v, 16), one)), 16);
    _mm512_storeu_si512(out, _mm512_packus_epi32(ru, rv));
}
#else
typedef __m256 cvec;
typedef __m256i cvec_i;
#define CV_ZERO_I() _mm256_setzero_si256()
#define CV_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define CV_WIDEN_LO(x) _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x))
#define CV_WIDEN_HI(x) _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x))
#define CV_ZERO() _mm256_setzero_ps()
#define CV_SET1(f) _mm256_set1_ps(f)
#define CV_LOAD(p) _mm256_loadu_ps(p)
#define CV_STORE(p, v) _mm256_storeu_ps(p, v)
#define CV_ADD(x, y) _mm256_add_ps(x, y)
#define CV_MUL(x, y) _mm256_mul_ps(x, y)
#define CV_FMA(x, y, z) _mm256_fmadd_ps(x, y, z)
#define CV_UNPACKLO(x, y) _mm256_unpacklo_ps(x, y)
#define CV_UNPACKHI(x, y) _mm256_unpackhi_ps(x, y)
#define CV_SHUFFLE(x, y, imm) _mm256_shuffle_ps(x, y, imm)
static inline cvec sum_quads(const cvec quads[2]) {
    return CV_ADD(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
static inline void store_part_bf16(uint16_t *out, cvec lo, cvec hi, cvec inv) {
    const __m256i half_ulp = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i u = _mm256_castps_si256(CV_MUL(lo, inv)), v = _mm256_castps_si256(CV_MUL(hi, inv));
    const __m256i ru = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half_ulp), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
    const __m256i rv = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, half_ulp), _mm256_and_si256(_mm256_srli_epi32(v, 16), one)), 16);
    _mm256_storeu_si256((__m256i *)out, _mm256_packus_epi32(ru, rv));
}
#endif
#if W == 16 && defined(__AVX512BF16__)
#define CHUNK_SCORES_DPBF16 1
#endif

static inline int takes_tiles(const args_t *a, int64_t r); /* (below: the prompt rows' tiles) */

static inline int takes_chunks(const args_t *a) {
    return a->q_bf16 && a->kv_bf16 && a->D % (2 * W) == 0 && !a->score_tiles;
}

typedef struct {
    const args_t *a;
    const int64_t *units;  /* [n][UNIT]: token, first key, keys, the token's visible keys, its
                            * chunk's partials' slot (-1: none), first KV head (of unit_kv_heads) */
    float *partials;       /* [slots][H][2 + D]: a chunk's max, sum and weighted values per head */
    const int64_t *merges; /* [m][3]: a token of several chunks: the token, its first chunk's slot, its chunks */
} chunks_t;
enum { UNIT = 6 };

/* KV heads a unit takes: two where there are 4 or more (an even count), so that a one-row step
 * of a model with few, long-context chunks still splits evenly (a 1B's 8 KV heads at 300
 * keys: 3 chunks, 12 units), else all of them. */
static inline int64_t unit_kv_heads(int64_t KVH) { return KVH >= 4 && KVH % 2 == 0 ? 2 : KVH; }

/* A token's chunks: as many as DECODE_CHUNK_KEYS keys make, an even number from 65 keys (two
 * threads then share a one-row step's chunks evenly: SmolLM2's attention 0.94-0.96x the time
 * in whole decode steps at 30-410 keys, where 129-384 keys made 2:1 splits and 65-128 none), the
 * keys shared out evenly in whole blocks (so at most DECODE_CHUNK_KEYS + block_size - 1 <=
 * DECODE_CHUNK a chunk). By the token's keys alone: its bits never depend on the threads. */
static inline int64_t chunk_keys(int64_t n_keys, int64_t block_size) {
    int64_t chunks = (n_keys + DECODE_CHUNK_KEYS - 1) / DECODE_CHUNK_KEYS;
    if (n_keys > DECODE_CHUNK_KEYS / 2 && chunks % 2) chunks++;
    const int64_t keys = (n_keys + chunks - 1) / chunks;
    return (keys + block_size - 1) / block_size * block_size;
}

/* Working memory of a part: the chunk's scores [H][DECODE_CHUNK + W] (room for whole W-lane
 * stores past its last key), then each head's max and sum. */
static inline int64_t chunk_work_floats(const args_t *a) { return a->H * (DECODE_CHUNK + W) + 2 * a->H; }

/* Weighted values (2 NL vectors in the interleave's order) times inv, stored as bf16. */
static inline __attribute__((always_inline)) void store_bf16_interleaved(uint16_t *out, const cvec *acc, cvec inv,
                                                                           const int64_t NL) {
    for (int64_t n = 0; n < NL; n++) store_part_bf16(out + n * 2 * W, acc[2 * n], acc[2 * n + 1], inv);
}

/* One unit: token t's keys [c_first, c_first + c_keys) of its n_keys, every head; the output
 * (a token of one chunk) or the chunk's state into `partial` ([H][2 + D]). Inlined with
 * constant `G` (query heads per KV head) and `NL` (parts of 2W channels per head) where usual. */
static inline __attribute__((always_inline)) int attend_chunk_as(const args_t *a, int64_t t, int64_t c_first,
                                                                   int64_t c_keys, int64_t n_keys, int64_t g_first,
                                                                   int64_t g_end, float *work, float *partial,
                                                                   const int64_t G, const int64_t NL) {
    const int64_t D = NL * 2 * W, BS = a->block_size, KVH = a->KVH, H = KVH * G, SW = DECODE_CHUNK + W;
    const int64_t key_stride = KVH * D; /* elements between consecutive slots */
    const uint16_t *K = (const uint16_t *)a->k, *V = (const uint16_t *)a->v;
    const uint16_t *q = (const uint16_t *)a->q + t * a->q_stride_t;
    const int32_t *table = a->tables + a->token_row[t] * a->table_stride;
    const cvec scale = CV_SET1(a->scale);
    float *s = work, *m = work + H * SW, *l = m + H;
    for (int64_t j0 = c_first; j0 < c_first + c_keys; j0 += BS) { /* scores, block by block */
        const int64_t block = table[j0 / BS];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int64_t nk = c_first + c_keys - j0 < BS ? c_first + c_keys - j0 : BS;
        const int64_t next = j0 + BS < n_keys ? table[j0 / BS + 1] : -1;
        for (int64_t g = g_first; g < g_end; g++) {
            const uint16_t *keys = K + block * BS * key_stride + g * D;
            /* the next block's K rows of this head (blocks lie anywhere: the hardware prefetcher
             * cannot guess the jump). Not V's, and not the whole block at once: on Zen 4 a
             * burst of a block's K and V lines, or V's rows here for the values' pass, made a
             * 1,350-key decode step's attention 1.10x slower than no prefetch at all; this
             * measured as fast as none there, and keeps the jump covered where a block's
             * successor is not the next in memory. */
            if (PREFETCH && next >= 0 && next < a->num_blocks)
                for (int64_t jj = 0; jj < BS; jj++)
                    for (int64_t byte = 0; byte < D * 2; byte += 64)
                        __builtin_prefetch((const char *)(K + (next * BS + jj) * key_stride + g * D) + byte);
#if defined(CHUNK_SCORES_DPBF16)
            __m512bh qg[MAX_GROUP][MAX_HEAD_DIM / 32];
            for (int64_t i = 0; i < G; i++)
                for (int64_t n = 0; n < NL; n++)
                    qg[i][n] = (__m512bh)_mm512_loadu_si512(q + (g * G + i) * a->q_stride_h + n * 32);
#else
            cvec qg[MAX_GROUP][MAX_HEAD_DIM / W]; /* widened in the order K is below */
            for (int64_t i = 0; i < G; i++)
                for (int64_t n = 0; n < NL; n++) {
                    const cvec_i x = CV_LOAD_I(q + (g * G + i) * a->q_stride_h + n * 2 * W);
                    qg[i][2 * n] = CV_WIDEN_LO(x);
                    qg[i][2 * n + 1] = CV_WIDEN_HI(x);
                }
#endif
            /* W keys at a time: the lanes past nk score zero keys; the next block's stores or
             * the softmax's bound overwrite or ignore them */
            for (int64_t c0 = 0; c0 < nk; c0 += W) {
                cvec quads[MAX_GROUP][W / 4]; /* head i, keys 4k..4k+3: one lane each a 128-bit block */
                for (int64_t k4 = 0; k4 < W / 4; k4++) {
                    cvec dot[MAX_GROUP][4];
                    for (int64_t jj = 0; jj < 4; jj++) {
                        const int64_t key = c0 + 4 * k4 + jj;
#if defined(CHUNK_SCORES_DPBF16)
                        __m512bh pairs[MAX_HEAD_DIM / 32];
                        for (int64_t n = 0; n < NL; n++)
                            pairs[n] = (__m512bh)(key < nk ? _mm512_loadu_si512(keys + key * key_stride + n * 32) : CV_ZERO_I());
                        for (int64_t i = 0; i < G; i++) {
                            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qg[i][0], pairs[0]);
                            for (int64_t n = 1; n < NL; n++) d = _mm512_dpbf16_ps(d, qg[i][n], pairs[n]);
                            dot[i][jj] = d;
                        }
#else
                        cvec widened[MAX_HEAD_DIM / W];
                        for (int64_t n = 0; n < NL; n++) {
                            const cvec_i x = key < nk ? CV_LOAD_I(keys + key * key_stride + n * 2 * W) : CV_ZERO_I();
                            widened[2 * n] = CV_WIDEN_LO(x);
                            widened[2 * n + 1] = CV_WIDEN_HI(x);
                        }
                        for (int64_t i = 0; i < G; i++) {
                            cvec d = CV_MUL(qg[i][0], widened[0]);
                            for (int64_t n = 1; n < 2 * NL; n++) d = CV_FMA(qg[i][n], widened[n], d);
                            dot[i][jj] = d;
                        }
#endif
                    }
                    for (int64_t i = 0; i < G; i++) {
                        const cvec ab = CV_ADD(CV_UNPACKLO(dot[i][0], dot[i][1]), CV_UNPACKHI(dot[i][0], dot[i][1]));
                        const cvec cd = CV_ADD(CV_UNPACKLO(dot[i][2], dot[i][3]), CV_UNPACKHI(dot[i][2], dot[i][3]));
                        quads[i][k4] = CV_ADD(CV_SHUFFLE(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), CV_SHUFFLE(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
                    }
                }
                for (int64_t i = 0; i < G; i++) /* across blocks: W keys' scores */
                    CV_STORE(s + (g * G + i) * SW + j0 - c_first + c0, CV_MUL(sum_quads(quads[i]), scale));
            }
        }
    }
    for (int64_t h = g_first * G; h < g_end * G; h++) { /* the chunk's softmax, from nothing */
        m[h] = -INFINITY;
        l[h] = 0.0f;
        softmax_block(s + h * SW, c_keys, &m[h], &l[h]);
    }
    for (int64_t g = g_first; g < g_end; g++) { /* weighted values, a KV head at a time */
        cvec acc[MAX_GROUP][MAX_HEAD_DIM / W];
        for (int64_t i = 0; i < G; i++)
            for (int64_t n = 0; n < 2 * NL; n++) acc[i][n] = CV_ZERO();
        for (int64_t j0 = c_first; j0 < c_first + c_keys; j0 += BS) {
            const int64_t nk = c_first + c_keys - j0 < BS ? c_first + c_keys - j0 : BS;
            const uint16_t *values = V + table[j0 / BS] * BS * key_stride + g * D; /* block checked above */
            /* the next block's rows (chunks start on a block: j0 is a block's first key) */
            const int64_t ahead_keys = c_first + c_keys - (j0 + BS);
            const uint16_t *ahead = ahead_keys > 0 ? V + table[j0 / BS + 1] * BS * key_stride + g * D : NULL;
            for (int64_t jj = 0; jj < nk; jj++) {
                cvec value[MAX_HEAD_DIM / W];
                /* The first head's pass also asks for the key's rows of the unit's other KV heads,
                 * which follow its own (a pass reads D of each key's (g_end - g_first) x D channels,
                 * and each later pass missed its rows again), and for all the unit's rows of the key
                 * a block ahead (a chunk's blocks lie anywhere: no hardware prefetcher runs ahead).
                 * Per layer after 64 MB of other memory, 1.14-1.84x at 1,024+ keys or 16 rows; the
                 * same arithmetic. Summing key by key over all the unit's heads instead (their
                 * accumulators spilled) was up to 2.6x slower for larger groups of heads
                 * (docs/performance.md#values-prefetch). */
                if (VALUES_PREFETCH && g == g_first) {
                    for (int64_t byte = 2 * D; byte < 2 * D * (g_end - g_first); byte += 64)
                        __builtin_prefetch((const char *)(values + jj * key_stride) + byte);
                    if (jj < ahead_keys)
                        for (int64_t byte = 0; byte < 2 * D * (g_end - g_first); byte += 64)
                            __builtin_prefetch((const char *)(ahead + jj * key_stride) + byte);
                }
                for (int64_t n = 0; n < NL; n++) {
                    const cvec_i x = CV_LOAD_I(values + jj * key_stride + n * 2 * W);
                    value[2 * n] = CV_WIDEN_LO(x);
                    value[2 * n + 1] = CV_WIDEN_HI(x);
                }
                for (int64_t i = 0; i < G; i++) {
                    const cvec p = CV_SET1(s[(g * G + i) * SW + j0 - c_first + jj]);
                    for (int64_t n = 0; n < 2 * NL; n++) acc[i][n] = CV_FMA(p, value[n], acc[i][n]);
                }
            }
        }
        for (int64_t i = 0; i < G; i++) {
            const int64_t h = g * G + i;
            if (partial == NULL) {
                store_bf16_interleaved((uint16_t *)a->out + (t * a->H + h) * D, acc[i], CV_SET1(1.0f / l[h]), NL);
            } else {
                float *state = partial + h * (2 + D);
                state[0] = m[h];
                state[1] = l[h];
                for (int64_t n = 0; n < 2 * NL; n++) CV_STORE(state + 2 + n * W, acc[i][n]);
            }
        }
    }
    return 0;
}

static int attend_chunk(const args_t *a, const int64_t *unit, float *work, float *partial) {
    const int64_t t = unit[0], c_first = unit[1], c_keys = unit[2], n_keys = unit[3], g0 = unit[5];
    const int64_t g1 = g0 + unit_kv_heads(a->KVH), G = a->H / a->KVH;
    if (n_keys <= 0) { /* padding or an unused row: zeros, as the reference gives */
        memset((uint16_t *)a->out + (t * a->H + g0 * G) * a->D, 0, (size_t)((g1 - g0) * G * a->D) * 2);
        return 0;
    }
    /* heads of 64 and 128 channels: 2 and 4 parts of 32 (AVX-512), 4 and 8 of 16 (AVX2) */
#define CHUNK_CASE(GG, DD) \
    if (G == GG && a->D == DD) return attend_chunk_as(a, t, c_first, c_keys, n_keys, g0, g1, work, partial, GG, DD / (2 * W));
    CHUNK_CASE(1, 64) CHUNK_CASE(2, 64) CHUNK_CASE(3, 64) CHUNK_CASE(4, 64)
    CHUNK_CASE(5, 64) CHUNK_CASE(6, 64) CHUNK_CASE(7, 64) CHUNK_CASE(8, 64)
    CHUNK_CASE(1, 128) CHUNK_CASE(2, 128) CHUNK_CASE(3, 128) CHUNK_CASE(4, 128)
    CHUNK_CASE(5, 128) CHUNK_CASE(6, 128) CHUNK_CASE(7, 128) CHUNK_CASE(8, 128)
#undef CHUNK_CASE
    return attend_chunk_as(a, t, c_first, c_keys, n_keys, g0, g1, work, partial, G, a->D / (2 * W));
}

static void *run_chunk_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const chunks_t *w = (const chunks_t *)p->args;
    const args_t *a = w->a;
    if (p->lo >= p->hi) return NULL;
    float *work = malloc((size_t)chunk_work_floats(a) * sizeof(float));
    if (!work) {
        p->status = -4;
        return NULL;
    }
    for (int64_t u = p->lo; u < p->hi; u++) {
        const int64_t *unit = w->units + UNIT * u;
        float *partial = unit[4] >= 0 ? w->partials + unit[4] * a->H * (2 + a->D) : NULL;
        if (attend_chunk(a, unit, work, partial) != 0) p->status = -1;
    }
    free(work);
    return NULL;
}

/* A token of several chunks: each head's states combined (the largest max as the common
 * scale), then divided by the sum and stored as bf16. */
static void *run_merge_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const chunks_t *w = (const chunks_t *)p->args;
    const args_t *a = w->a;
    const int64_t D = a->D, NL = D / (2 * W), stride = a->H * (2 + D);
    for (int64_t item = p->lo; item < p->hi; item++) {
        const int64_t t = w->merges[3 * item], chunks = w->merges[3 * item + 2];
        const float *states = w->partials + w->merges[3 * item + 1] * stride; /* its chunks' slots are consecutive */
        for (int64_t h = 0; h < a->H; h++) {
            float top = -INFINITY;
            for (int64_t c = 0; c < chunks; c++) top = states[c * stride + h * (2 + D)] > top ? states[c * stride + h * (2 + D)] : top;
            cvec acc[MAX_HEAD_DIM / W];
            for (int64_t n = 0; n < 2 * NL; n++) acc[n] = CV_ZERO();
            float sum = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *state = states + c * stride + h * (2 + D);
                const float factor = exp_nonpositive(state[0] - top);
                sum += state[1] * factor;
                for (int64_t n = 0; n < 2 * NL; n++) acc[n] = CV_FMA(CV_LOAD(state + 2 + n * W), CV_SET1(factor), acc[n]);
            }
            store_bf16_interleaved((uint16_t *)a->out + (t * a->H + h) * D, acc, CV_SET1(1.0f / sum), NL);
        }
    }
    return NULL;
}

/* Token t's chunks (0: its row took tiles), its visible keys (*n_keys) and a chunk's keys (*keys). */
static inline int64_t token_chunks(const args_t *a, int64_t t, int tiles_done, int64_t *n_keys, int64_t *keys) {
    int64_t row;
    *n_keys = visible_keys(a, t, &row);
    if (tiles_done && *n_keys > 0 && takes_tiles(a, row)) return 0;
    *keys = *n_keys > 0 ? chunk_keys(*n_keys, a->block_size) : 1;
    return *n_keys > *keys ? (*n_keys + *keys - 1) / *keys : 1;
}

/* The per-token pass in chunks (every token not done by tiles): returns 0, -1 (a block id
 * outside the cache) or -4 (out of memory). */
static int attend_in_chunks(const args_t *a, int tiles_done, int threads) {
    const int64_t per_unit = unit_kv_heads(a->KVH), groups = a->KVH / per_unit;
    int64_t n_units = 0, n_slots = 0, n_merges = 0, n_keys, keys;
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t chunks = token_chunks(a, t, tiles_done, &n_keys, &keys);
        n_units += chunks * groups;
        if (chunks > 1) {
            n_slots += chunks;
            n_merges++;
        }
    }
    if (n_units == 0) return 0;
    int64_t *units = malloc((size_t)(UNIT * n_units + 3 * n_merges) * sizeof(int64_t));
    float *partials = n_slots ? malloc((size_t)(n_slots * a->H * (2 + a->D)) * sizeof(float)) : NULL;
    if (!units || (n_slots && !partials)) {
        free(units);
        free(partials);
        return -4;
    }
    int64_t *merges = units + UNIT * n_units;
    for (int64_t t = 0, u = 0, slot = 0, mg = 0; t < a->T; t++) {
        const int64_t chunks = token_chunks(a, t, tiles_done, &n_keys, &keys);
        if (chunks > 1) {
            merges[3 * mg] = t;
            merges[3 * mg + 1] = slot;
            merges[3 * mg + 2] = chunks;
            mg++;
        }
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t k = 0; k < groups; k++, u++) {
                int64_t *unit = units + UNIT * u;
                unit[0] = t;
                unit[1] = c * keys;
                unit[2] = n_keys - c * keys < keys ? n_keys - c * keys : keys;
                unit[3] = n_keys;
                unit[4] = chunks > 1 ? slot : -1;
                unit[5] = k * per_unit;
            }
            if (chunks > 1) slot++;
        }
    }
    const chunks_t work = {a, units, partials, merges};
    int status = blink_run_parts(run_chunk_part, &work, n_units, threads);
    if (status == 0 && n_merges > 0) status = blink_run_parts(run_merge_part, &work, n_merges, threads);
    free(units);
    free(partials);
    return status;
}
#endif

/* attend_as with the call's shapes as constants where they are usual ones: heads of 4 or 8
 * vectors, and for fp32 in AVX-512 builds 1-8 query heads per KV head (GROUP_CASES). */
static int attend(const args_t *a, int64_t t, int64_t g) {
    const int64_t NV = a->D / W, G = a->H / a->KVH;
    (void)G; /* (unused where GROUP_CASES is empty: an AVX2 build) */
#if W == 16 && DECODE_CASES /* (an AVX2 build measured 1.0-1.3x with G constant: not worth its build's time) */
#define GROUP_CASES(NVV) \
    switch (G) { \
    case 1: return attend_as(a, t, g, 0, NVV, 1); \
    case 2: return attend_as(a, t, g, 0, NVV, 2); \
    case 3: return attend_as(a, t, g, 0, NVV, 3); \
    case 4: return attend_as(a, t, g, 0, NVV, 4); \
    case 5: return attend_as(a, t, g, 0, NVV, 5); \
    case 6: return attend_as(a, t, g, 0, NVV, 6); \
    case 7: return attend_as(a, t, g, 0, NVV, 7); \
    case 8: return attend_as(a, t, g, 0, NVV, 8); \
    default: break; \
    }
#else
#define GROUP_CASES(NVV)
#endif
    if (a->kv_bf16) { /* (AVX-512 builds: bf16 takes attend_in_chunks but under AMX scores) */
        if (NV == 4) return attend_as(a, t, g, 1, 4, 0);
        if (NV == 8) return attend_as(a, t, g, 1, 8, 0);
        return attend_as(a, t, g, 1, NV, 0);
    }
    if (NV == 4) { GROUP_CASES(4) }
    if (NV == 8) { GROUP_CASES(8) }
    if (NV == 4) return attend_as(a, t, g, 0, 4, 0);
    if (NV == 8) return attend_as(a, t, g, 0, 8, 0);
    return attend_as(a, t, g, 0, NV, 0);
#undef GROUP_CASES
}


#if TILES && defined(__AVX512F__)

/* r[j][i] <- r[i][j] for a 16 x 16 block of 32-bit lanes: pairs of rows interleaved, then
 * pairs of pairs, then 128-bit lanes exchanged twice (64 shuffles). */
static inline void transpose16x16(__m512 r[16]) {
    __m512 lo[8], hi[8], u[4][4];
    for (int a = 0; a < 8; a++) {
        lo[a] = _mm512_unpacklo_ps(r[2 * a], r[2 * a + 1]);
        hi[a] = _mm512_unpackhi_ps(r[2 * a], r[2 * a + 1]);
    }
    for (int b = 0; b < 4; b++) { /* u[b][k], 128-bit lane L: column 4L + k of rows 4b..4b+3 */
        const __m512d l0 = _mm512_castps_pd(lo[2 * b]), l1 = _mm512_castps_pd(lo[2 * b + 1]);
        const __m512d h0 = _mm512_castps_pd(hi[2 * b]), h1 = _mm512_castps_pd(hi[2 * b + 1]);
        u[b][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(l0, l1));
        u[b][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(l0, l1));
        u[b][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(h0, h1));
        u[b][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(h0, h1));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[0][k], u[1][k], 0x44), v1 = _mm512_shuffle_f32x4(u[0][k], u[1][k], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[2][k], u[3][k], 0x44), v3 = _mm512_shuffle_f32x4(u[2][k], u[3][k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}

/* Where a query of row r sees keys [0, limit]: queries [t0, t0 + n) of the row (n <= 16) get
 * their limits, whether each is the row's (valid: padding past n or another row's token sees
 * key 0, finite sums never stored), and the furthest key any query sees (last) and every
 * query sees (first). */
static void query_limits(const args_t *a, int64_t r, int64_t t0, int64_t n, int32_t limit[16], int valid[16],
                         int64_t *first, int64_t *last) {
    const int64_t seq = a->seq_lens[r], keys_max = a->table_cols * a->block_size;
    *last = 0, *first = INT64_MAX;
    for (int64_t i = 0; i < 16; i++) {
        const int64_t t = t0 + i;
        valid[i] = i < n && a->token_row[t] == r;
        int64_t lim = 0;
        if (valid[i]) {
            lim = a->positions[t] < seq - 1 ? a->positions[t] : seq - 1;
            if (lim > keys_max - 1) lim = keys_max - 1;
            if (lim < 0) valid[i] = 0, lim = 0;
        }
        limit[i] = (int32_t)lim;
        if (lim > *last) *last = lim;
        if (lim < *first) *first = lim;
    }
}

/* out = (acc^T / l)^T for the tile's valid queries [t0, t0 + 16) of head h, 16 channels at a
 * time (acc: out^T, [channel][query], both tile kinds). */
static void store_tile_out(const args_t *a, const float *acc, __m512 l, int64_t t0, int64_t h, const int valid[16]) {
    const int64_t D = a->D;
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 rows[16];
        for (int64_t d = 0; d < 16; d++) rows[d] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + d) * 16), inv);
        transpose16x16(rows);
        for (int64_t i = 0; i < 16; i++)
            if (valid[i]) {
                vf out;
                memcpy(&out, &rows[i], sizeof out);
                store_vec(a->out, ((t0 + i) * a->H + h) * D + d0, out, a->q_bf16);
            }
    }
}

/* Prompt rows on AVX-512 (any CPU with it; with AMX, rows that AMX's tiles do not take): the
 * per-token pass does one key at a time with a horizontal sum per 16 keys and an exp per key
 * and head (~110 ns per (token, key) on a 1B's prompts, 32 heads, two Zen 4 cores), and SDPA
 * took 13% of a 16-row prompt step of 1,032 tokens there. Instead, as AMX's tiles: the row's K
 * and V laid out once per (row, KV head), here as fp32 rows, then per head tiles of FQ queries
 * over chunks of FK keys, scores^T (keys x queries: the online softmax runs down the lanes,
 * one query a lane) as FMAs of a broadcast key channel with the queries' transposed channel,
 * out^T += V^T P^T the same way, everything in fp32 (nothing rounded to bf16, unlike AMX's
 * probabilities). */
enum { FQ = 16, FK = 16 };

/* A row takes tiles (either kind) from TILE_MIN_TOKENS new tokens: below, laying out its
 * context costs more than the per-token pass saves (AVX-512's tiles: 1.13-1.15x the pass at
 * 8 new tokens over 100-200 cached, Zen 4). */
enum { TILE_MIN_TOKENS = 8 };

static inline __m512 load16_ps(const void *base, int64_t index, int bf16) {
    const vf f = load_vec(base, index, bf16);
    __m512 r;
    memcpy(&r, &f, sizeof r);
    return r;
}

/* Rows of one laid-out context: whole chunks of FK keys. */
static inline int64_t f_padded(int64_t n_ctx) { return (n_ctx + FK - 1) / FK * FK; }

/* Row r's keys [0, n_ctx) of KV head g as fp32 rows of D channels: keys, then values, each
 * f_padded(n_ctx) rows, the last chunk's missing keys zeros. Returns -1 for a block id
 * outside the cache. */
static int lay_out_context_f32(const args_t *a, int64_t r, int64_t g, int64_t n_ctx, float *keys) {
    const int64_t D = a->D, BS = a->block_size, key_stride = a->KVH * D, padded = f_padded(n_ctx);
    float *values = keys + padded * D;
    const int32_t *table = a->tables + r * a->table_stride;
    for (int64_t key = 0; key < n_ctx; key++) {
        const int64_t block = table[key / BS];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int64_t at = (block * BS + key % BS) * key_stride + g * D;
        for (int64_t d = 0; d < D; d += W) {
            _mm512_storeu_ps(keys + key * D + d, load16_ps(a->k, at + d, a->kv_bf16));
            _mm512_storeu_ps(values + key * D + d, load16_ps(a->v, at + d, a->kv_bf16));
        }
    }
    memset(keys + n_ctx * D, 0, (size_t)((padded - n_ctx) * D) * sizeof(float));
    memset(values + n_ctx * D, 0, (size_t)((padded - n_ctx) * D) * sizeof(float));
    return 0;
}

/* Queries [t0, t0 + n) of row r, head h (n <= FQ), over its laid-out context (keys: see
 * lay_out_context_f32; n_ctx its length). */
static void attend_tile_f32(const args_t *a, int64_t r, int64_t h, int64_t t0, int64_t n, const float *keys,
                            int64_t n_ctx) {
    const int64_t D = a->D;
    const float *values = keys + f_padded(n_ctx) * D;
    float q_t[MAX_HEAD_DIM * FQ] __attribute__((aligned(64))); /* [channel][query], times the scale */
    float acc[MAX_HEAD_DIM * FQ] __attribute__((aligned(64))); /* out^T: [channel][query] */
    int32_t limit[FQ] __attribute__((aligned(64)));
    int valid[FQ];
    int64_t first, last;
    query_limits(a, r, t0, n, limit, valid, &first, &last);
    const __m512 scale = _mm512_set1_ps(a->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t d0 = 0; d0 < D; d0 += 16) { /* q_t: the queries' channels, transposed and scaled */
        __m512 rows[16];
        for (int64_t i = 0; i < FQ; i++)
            rows[i] = valid[i] ? _mm512_mul_ps(load16_ps(a->q, (t0 + i) * a->q_stride_t + h * a->q_stride_h + d0, a->q_bf16), scale)
                               : _mm512_setzero_ps();
        transpose16x16(rows);
        for (int64_t p = 0; p < 16; p++) _mm512_store_ps(q_t + (d0 + p) * FQ, rows[p]);
    }
    memset(acc, 0, sizeof(float) * FQ * D);
    const __m512i limits = _mm512_load_si512(limit);
    __m512 m = minus_inf, l = _mm512_setzero_ps();
    for (int64_t c = 0; c * FK <= last; c++) {
        const float *kc = keys + c * FK * D, *vc = values + c * FK * D;
        __m512 s[FK];
#pragma GCC unroll 16
        for (int j = 0; j < FK; j++) s[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) { /* scores^T[j] = sum over d of k[j][d] q_t[d] */
            const __m512 qd = _mm512_load_ps(q_t + d * FQ);
#pragma GCC unroll 16
            for (int j = 0; j < FK; j++) s[j] = _mm512_fmadd_ps(_mm512_set1_ps(kc[j * D + d]), qd, s[j]);
        }
        const int whole = c * FK + FK - 1 <= first; /* every query sees every key of the chunk */
        __m512 chunk_max = minus_inf;
#pragma GCC unroll 16
        for (int j = 0; j < FK; j++) { /* query i sees key c FK + j when it is <= limit[i] */
            if (!whole)
                s[j] = _mm512_mask_mov_ps(minus_inf, _mm512_cmpge_epi32_mask(limits, _mm512_set1_epi32((int)(c * FK + j))), s[j]);
            chunk_max = _mm512_max_ps(chunk_max, s[j]);
        }
        const __m512 new_max = _mm512_max_ps(m, chunk_max); /* finite: every query sees key 0 */
        const __m512 correction = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, minus_inf, _CMP_NEQ_OQ),
                                                      exp_nonpositive16(_mm512_sub_ps(m, new_max)));
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < FK; j++) {
            const __m512 p = exp_nonpositive16(_mm512_sub_ps(s[j], new_max));
            s[j] = whole ? p : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[j], minus_inf, _CMP_NEQ_OQ), p);
            sum = _mm512_add_ps(sum, s[j]);
        }
        l = _mm512_fmadd_ps(l, correction, sum);
        m = new_max;
        for (int64_t d0 = 0; d0 < D; d0 += 8) { /* out^T = out^T correction + V^T P^T, 8 channels at a time */
            __m512 o[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) o[e] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + e) * FQ), correction);
#pragma GCC unroll 16
            for (int j = 0; j < FK; j++)
#pragma GCC unroll 8
                for (int e = 0; e < 8; e++) o[e] = _mm512_fmadd_ps(_mm512_set1_ps(vc[j * D + d0 + e]), s[j], o[e]);
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) _mm512_store_ps(acc + (d0 + e) * FQ, o[e]);
        }
    }
    store_tile_out(a, acc, l, t0, h, valid);
}

#if defined(BLINK_AMX)
/* QT queries per tile (AMX's 16 rows), KC keys per chunk (one bf16 product's depth). */
enum { QT = 16, KC = 32 };

/* Every tile 16 rows x 64 bytes. 0, 1: scores^T (keys x queries, fp32) of a chunk's two
 * 16-key halves; 2: the second operand (query pairs, then probability pairs); 3, 4: K or V^T
 * operands; 4-7: out^T (channels x queries, fp32) products. */
static void configure_tiles(void) {
    blink_tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* Bytes of one chunk's laid-out K and V: K as 2 halves x D/32 tiles, V as D/16. */
static inline int64_t chunk_bytes(int64_t D) { return 2 * (D / 32) * 1024 + (D / 16) * 1024; }

/* Row r's keys [0, n_ctx) of KV head g, laid out per 32-key chunk as the products' first
 * operands: K as tiles of 16 keys x 32 channels (the scores come out transposed, keys x
 * queries, so that the softmax runs down columns with no horizontal reductions), V
 * transposed as tiles of 16 channels x 32 keys. Keys past n_ctx are zeros. Returns -1 for a
 * block id outside the cache. */
static int lay_out_context(const args_t *a, int64_t r, int64_t g, int64_t n_ctx, uint16_t *scratch) {
    const int64_t D = a->D, BS = a->block_size, key_stride = a->KVH * D;
    const int32_t *table = a->tables + r * a->table_stride;
    const uint16_t *k = (const uint16_t *)a->k, *v = (const uint16_t *)a->v;
    const int64_t chunks = (n_ctx + KC - 1) / KC, per_chunk = chunk_bytes(D) / 2;
    if (n_ctx % KC) { /* the last chunk's missing keys */
        uint16_t *last = scratch + (chunks - 1) * per_chunk;
        memset(last, 0, (size_t)chunk_bytes(D));
    }
    for (int64_t key = 0; key < n_ctx; key++) {
        const int64_t block = table[key / BS];
        if (block < 0 || block >= a->num_blocks) return -1;
        const int64_t at = (block * BS + key % BS) * key_stride + g * D;
        uint16_t *chunk = scratch + (key / KC) * per_chunk;
        const int64_t j = key % KC;
        uint16_t *kt = chunk + (j / 16) * (D / 32) * 512 + (j % 16) * 32;
        for (int64_t dc = 0; dc < D / 32; dc++) memcpy(kt + dc * 512, k + at + dc * 32, 64);
        const uint16_t *vrow = v + at;
        uint16_t *vt = chunk + 2 * (D / 32) * 512 + j;
        for (int64_t d = 0; d < D; d++) vt[(d / 16) * 512 + (d % 16) * 32] = vrow[d];
    }
    return 0;
}

/* The tile of queries [t0, t0 + n) of row r, head h (n <= QT), over the laid-out context. */
static void attend_tile(const args_t *a, int64_t r, int64_t h, int64_t t0, int64_t n, const uint16_t *scratch) {
    const int64_t D = a->D, per_chunk = chunk_bytes(D) / 2;
    uint32_t q_pairs[(MAX_HEAD_DIM / 2) * QT] __attribute__((aligned(64))); /* [D/2 pairs][QT] */
    uint16_t prob_pairs[(KC / 2) * QT * 2] __attribute__((aligned(64)));   /* [KC/2 pairs][QT][2] */
    float scores[KC * QT] __attribute__((aligned(64)));                     /* [keys][queries] */
    float product[4 * 16 * QT] __attribute__((aligned(64)));                /* [4 x 16 channels][queries] */
    float acc[MAX_HEAD_DIM * QT] __attribute__((aligned(64)));              /* [channels][queries] */
    int32_t limit[QT] __attribute__((aligned(64)));
    int valid[QT];
    int64_t first, last; /* the furthest key every query / any query sees */
    query_limits(a, r, t0, n, limit, valid, &first, &last);
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) { /* q_pairs: the queries' channel pairs, transposed */
        __m512 r[16];
        for (int64_t i = 0; i < QT; i++)
            r[i] = valid[i] ? _mm512_loadu_ps((const uint16_t *)a->q + (t0 + i) * a->q_stride_t + h * a->q_stride_h + 2 * p0)
                            : _mm512_setzero_ps();
        transpose16x16(r);
        for (int64_t p = 0; p < 16; p++) _mm512_store_ps((float *)(q_pairs + (p0 + p) * QT), r[p]);
    }
    memset(acc, 0, sizeof(float) * QT * D);
    const __m512 scale = _mm512_set1_ps(a->scale), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512i limits = _mm512_load_si512(limit);
    /* bf16 pairs [p_2k(q), p_2k+1(q)] from [p_2k(0..15), p_2k+1(0..15)] */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 m = minus_inf, l = _mm512_setzero_ps();
    for (int64_t c = 0; c * KC <= last; c++) {
        const uint16_t *chunk = scratch + c * per_chunk;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t dc = 0; dc < D / 32; dc++) { /* scores^T = K . Q^T */
            _tile_loadd(2, q_pairs + dc * 16 * QT, 64);
            _tile_loadd(3, chunk + dc * 512, 64);
            _tile_dpbf16ps(0, 3, 2);
            _tile_loadd(4, chunk + ((D / 32) + dc) * 512, 64);
            _tile_dpbf16ps(1, 4, 2);
        }
        _tile_stored(0, scores, 64);
        _tile_stored(1, scores + 16 * QT, 64);
        __m512 s[KC];
        __m512 chunk_max = minus_inf;
        const int whole = c * KC + KC - 1 <= first; /* every query sees every key of the chunk */
        for (int64_t j = 0; j < KC; j++) { /* query i sees key c*KC + j when it is <= limit[i] */
            const __m512 scaled = _mm512_mul_ps(_mm512_load_ps(scores + j * QT), scale);
            s[j] = whole ? scaled : _mm512_mask_mov_ps(minus_inf, _mm512_cmpge_epi32_mask(limits, _mm512_set1_epi32((int)(c * KC + j))), scaled);
            chunk_max = _mm512_max_ps(chunk_max, s[j]);
        }
        const __m512 new_max = _mm512_max_ps(m, chunk_max); /* finite: every query sees key 0 */
        const __m512 correction = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, minus_inf, _CMP_NEQ_OQ),
                                                      exp_nonpositive16(_mm512_sub_ps(m, new_max)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < KC; j += 2) {
            const __m512 p0 = exp_nonpositive16(_mm512_sub_ps(s[j], new_max)), p1 = exp_nonpositive16(_mm512_sub_ps(s[j + 1], new_max));
            const __m512 z0 = whole ? p0 : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[j], minus_inf, _CMP_NEQ_OQ), p0);
            const __m512 z1 = whole ? p1 : _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[j + 1], minus_inf, _CMP_NEQ_OQ), p1);
            sum = _mm512_add_ps(sum, _mm512_add_ps(z0, z1));
            _mm512_store_si512(prob_pairs + j * QT,
                               _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(z1, z0)));
        }
        l = _mm512_fmadd_ps(l, correction, sum);
        m = new_max;
        _tile_loadd(2, prob_pairs, 64);
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* out^T += V^T . P^T, four channel tiles at a time */
            const int64_t tiles = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            const uint16_t *vt = chunk + (2 * (D / 32) + d0 / 16) * 512;
            _tile_zero(4); _tile_loadd(3, vt, 64); _tile_dpbf16ps(4, 3, 2);
            if (tiles > 1) { _tile_zero(5); _tile_loadd(3, vt + 512, 64); _tile_dpbf16ps(5, 3, 2); }
            if (tiles > 2) { _tile_zero(6); _tile_loadd(3, vt + 1024, 64); _tile_dpbf16ps(6, 3, 2); }
            if (tiles > 3) { _tile_zero(7); _tile_loadd(3, vt + 1536, 64); _tile_dpbf16ps(7, 3, 2); }
            _tile_stored(4, product, 64);
            if (tiles > 1) _tile_stored(5, product + 256, 64);
            if (tiles > 2) _tile_stored(6, product + 512, 64);
            if (tiles > 3) _tile_stored(7, product + 768, 64);
            for (int64_t d = 0; d < tiles * 16; d++)
                _mm512_store_ps(acc + (d0 + d) * QT, _mm512_fmadd_ps(_mm512_load_ps(acc + (d0 + d) * QT), correction,
                                                                     _mm512_load_ps(product + d * QT)));
        }
    }
    store_tile_out(a, acc, l, t0, h, valid); /* (bf16 queries: store_vec rounds as store_bf16x16) */
}

#endif /* BLINK_AMX */

typedef struct {
    const args_t *a;
    const int32_t *tile_rows; /* the rows that take tiles */
    int64_t scratch_bytes;    /* the longest tile row's laid-out context */
    int amx;                  /* AMX's tiles, else AVX-512's */
} tiles_t;

/* Items: (tile row, KV head) pairs. */
static void *run_tile_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const tiles_t *w = (const tiles_t *)p->args;
    const args_t *a = w->a;
    if (p->lo >= p->hi) return NULL;
    void *scratch = aligned_alloc(64, (size_t)w->scratch_bytes);
    if (!scratch) { p->status = -4; return NULL; }
#if defined(BLINK_AMX)
    if (w->amx) configure_tiles();
#endif
    const int64_t G = a->H / a->KVH, keys_max = a->table_cols * a->block_size;
    for (int64_t item = p->lo; item < p->hi; item++) {
        const int64_t r = w->tile_rows[item / a->KVH], g = item % a->KVH;
        const int64_t q0 = a->query_start[r], q1 = a->query_start[r + 1];
        int64_t n_ctx = a->seq_lens[r] < keys_max ? a->seq_lens[r] : keys_max;
#if defined(BLINK_AMX)
        if (w->amx) {
            if (lay_out_context(a, r, g, n_ctx, scratch) != 0) { p->status = -1; break; }
            for (int64_t i = 0; i < G; i++)
                for (int64_t t0 = q0; t0 < q1; t0 += QT)
                    attend_tile(a, r, g * G + i, t0, q1 - t0 < QT ? q1 - t0 : QT, scratch);
            continue;
        }
#endif
        if (lay_out_context_f32(a, r, g, n_ctx, scratch) != 0) { p->status = -1; break; }
        for (int64_t i = 0; i < G; i++)
            for (int64_t t0 = q0; t0 < q1; t0 += FQ)
                attend_tile_f32(a, r, g * G + i, t0, q1 - t0 < FQ ? q1 - t0 : FQ, scratch, n_ctx);
    }
#if defined(BLINK_AMX)
    if (w->amx) _tile_release(); /* tile state left loaded would cost every context switch an 8 KB save */
#endif
    free(scratch);
    return NULL;
}

/* Whether row r takes tiles (either kind): TILE_MIN_TOKENS new tokens or more. */
static inline int takes_tiles(const args_t *a, int64_t r) {
    const int64_t n_new = a->query_start[r + 1] - a->query_start[r];
    return a->seq_lens[r] > 0 && n_new >= TILE_MIN_TOKENS && a->query_start[r] >= 0
           && a->query_start[r + 1] <= a->T;
}

/* The new-token count from which a row takes tiles (kernels/cpu/attention.py's cost estimate
 * reads it); 0 where the build has none. */
int blink_paged_attention_tile_min_tokens(void) { return TILE_MIN_TOKENS; }
/* 1 where bf16 prompt rows with whole 32-channel parts take AMX's tiles, 0 where AVX-512's
 * (the cost estimate's figure differs) */
int blink_paged_attention_tiles_on_amx(void) {
#if defined(BLINK_AMX)
    return amx_allowed && blink_amx_granted();
#else
    return 0;
#endif
}

/* Whether a call's prompt rows take AMX's tiles (bf16 queries and cache, whole 32-channel
 * parts), else AVX-512's. */
static int tiles_on_amx(const args_t *a) {
    return blink_paged_attention_tiles_on_amx() && a->q_bf16 && a->kv_bf16 && a->D % 32 == 0;
}
#define HAVE_TILES 1
#else
int blink_paged_attention_tile_min_tokens(void) { return 0; }
int blink_paged_attention_tiles_on_amx(void) { return 0; }
static inline int takes_tiles(const args_t *a, int64_t r) { (void)a; (void)r; return 0; }
#define HAVE_TILES 0
#endif

typedef struct {
    const args_t *a;
    int tiles_done; /* the rows that take tiles have been attended */
} tokens_t;

/* Items: (token, KV head) pairs; a token of a row that took tiles is already done. */
static void *run_token_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const tokens_t *w = (const tokens_t *)p->args;
    const args_t *a = w->a;
#if SCORE_TILES
    if (a->score_tiles && p->lo < p->hi) configure_score_tiles(a->H / a->KVH);
#endif
    for (int64_t item = p->lo; item < p->hi; item++) {
        const int64_t t = item / a->KVH;
        if (w->tiles_done) {
            const int64_t row = a->token_row[t];
            if (row >= 0 && row < a->rows && takes_tiles(a, row) && t >= a->query_start[row]
                && t < a->query_start[row + 1])
                continue;
        }
        if (attend(a, t, item % a->KVH) != 0) p->status = -1;
    }
#if SCORE_TILES
    if (a->score_tiles && p->lo < p->hi) _tile_release();
#endif
    return NULL;
}

/* The step's key visits: each live row's new tokens times its context. Counted here from the
 * metadata, not passed in, so that every scalar argument is a shape: a recorded call
 * (graph.py) stays right when the contexts grow. */
static int64_t key_visits(const int32_t *query_start, const int32_t *seq_lens, int64_t rows) {
    int64_t visits = 0;
    for (int64_t r = 0; r < rows; r++)
        if (seq_lens[r] > 0) visits += (int64_t)(query_start[r + 1] - query_start[r]) * seq_lens[r];
    return visits;
}

/* Returns 0; -1 when a block id lies outside the cache; -2 for shapes this kernel does not
 * take (the caller checks them first, so this is a last guard); -4 out of memory (the tiles'
 * or the chunks' scratch). `threads` splits the (token, KV head) pairs (or the chunks), and
 * the tile rows' (row, KV head) pairs, when there are enough keys to pay for starting threads. */
int blink_paged_attention(const void *q, int64_t q_stride_t, int64_t q_stride_h, void *out, const void *k, const void *v, int q_bf16,
                          int kv_bf16, int64_t T, int64_t H, int64_t KVH, int64_t D,
                          int64_t block_size, int64_t num_blocks, int64_t rows,
                          const int64_t *token_row, const int64_t *positions,
                          const int32_t *query_start, const int32_t *seq_lens,
                          const int32_t *tables, int64_t table_stride, int64_t table_cols,
                          float scale, int threads) {
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D % W != 0 || D > MAX_HEAD_DIM
        || block_size > MAX_BLOCK)
        return -2;
    args_t a = {q, q_stride_t, q_stride_h, out, k, v, q_bf16, kv_bf16, T, H, KVH, D, block_size, num_blocks, rows,
                token_row, positions, query_start, seq_lens, tables, table_stride, table_cols, scale};
    /* one thread per 2^16 multiply-adds of scores (key visits x query heads x channels) at
     * most, ~12-18 us of work on a Zen 4 core: a one-row decode step of a 1B (32 heads of 64)
     * splits from 64 cached keys (its attention 1.8x faster on two threads at 300), and a
     * worker that is not running leaves its part to this thread (pool.c) */
    const int64_t score_work = key_visits(query_start, seq_lens, rows) * H * D;
#if defined(CHUNKED_DECODE)
    const int threads_given = threads;
#endif
    threads = blink_threads_for(score_work, (int64_t)1 << 16, threads);
#if SCORE_TILES
    a.score_tiles = takes_score_tiles(&a);
#endif
    tokens_t tokens = {&a, 0};
#if HAVE_TILES
    const int amx = tiles_on_amx(&a);
    int64_t count = 0, longest = 0; /* rows that take tiles, and the longest one's context */
    for (int64_t r = 0; r < rows; r++)
        if (takes_tiles(&a, r)) {
            count++;
            longest = seq_lens[r] > longest ? seq_lens[r] : longest;
        }
    if (count > 0) {
        int32_t *tile_rows = malloc((size_t)count * sizeof *tile_rows);
        if (!tile_rows) return -4;
        for (int64_t r = 0, i = 0; r < rows; r++)
            if (takes_tiles(&a, r)) tile_rows[i++] = (int32_t)r;
        if (longest > table_cols * block_size) longest = table_cols * block_size;
        int64_t scratch = 2 * f_padded(longest) * D * (int64_t)sizeof(float);
#if defined(BLINK_AMX)
        if (amx) scratch = ((longest + KC - 1) / KC) * chunk_bytes(D);
#endif
        tiles_t tiles = {&a, tile_rows, scratch, amx};
        const int status = blink_run_parts(run_tile_part, &tiles, count * KVH, threads);
        free(tile_rows);
        if (status != 0) return status;
        tokens.tiles_done = 1;
    }
#endif
#if defined(CHUNKED_DECODE)
    /* the chunks split from 2^14 multiply-adds a thread: a decode step's units read a cache the
     * weights have flushed, and two threads wait for it side by side (a one-row SmolLM2 layer at
     * 154 keys, 88K multiply-adds: 20 -> 13.5 us on Zen 4, the whole step's calls timed) */
    if (takes_chunks(&a))
        return attend_in_chunks(&a, tokens.tiles_done, blink_threads_for(score_work, (int64_t)1 << 14, threads_given));
#endif
    return blink_run_parts(run_token_part, &tokens, T * KVH, threads);
}
