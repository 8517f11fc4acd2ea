/* Paged attention for the eager CPU forward, reading K/V where they lie in the paged cache.
 *
 * The torch path (kernels/cpu_attention.py) gathers every query tile's context with
 * index_select, lays the queries out in tiles and runs SDPA, about ten aten ops and two
 * copies of the context per layer. For a decode step the compute is tiny (16 rows x 9 heads
 * x a few hundred keys), so those copies and per-op costs were ~25% of a 16-row SmolLM2 step.
 * Here each (token, KV head) pair is one online-softmax pass over its sequence's blocks,
 * the G query heads that share the KV head together, so each K/V element is read once per
 * token, in the cache's dtype, and never copied.
 *
 * Semantics are the reference's (kernels/reference.py paged_attention): token t of row r
 * (t inside r's span of query_start_loc) attends to positions j <= min(positions[t],
 * seq_lens[r] - 1); every other token (bucket padding, unused rows) gets zeros. Accumulation
 * is fp32 whatever the dtypes. Built at first use by kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* benchmarks/bench_forward.py --before attention-no-prefetch builds with -DPREFETCH=0 */
#ifndef PREFETCH
#define PREFETCH 1
#endif

/* Limits of the per-call stack arrays; kernels/cpu_attention.py sends larger shapes to the
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
} args_t;


/* 16 floats: one AVX-512 register, two AVX2 ones; the compiler lowers it for the host. */
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
enum { W = 16 };

static inline vf load16(const void *base, int64_t index, int bf16) {
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

static inline void store16(void *base, int64_t index, vf f, int bf16) {
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

/* r[j] = sum of v[j]'s lanes, j < 16: four levels of pairwise shuffles and adds (15 adds
 * for 16 keys instead of a horizontal sum per key). Each level halves every vector's
 * partial sums and packs two vectors into one, keeping the keys in order. */
static inline vf reduce16(vf v[W]) {
#define LO1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define PAIR(x, y, LO, HI) (__builtin_shufflevector(x, y, LO) + __builtin_shufflevector(x, y, HI))
    vf a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = PAIR(v[2 * j], v[2 * j + 1], LO1, HI1);
    for (int j = 0; j < 4; j++) b[j] = PAIR(a[2 * j], a[2 * j + 1], LO2, HI2);
    for (int j = 0; j < 2; j++) c[j] = PAIR(b[2 * j], b[2 * j + 1], LO3, HI3);
    return PAIR(c[0], c[1], LO4, HI4);
#undef PAIR
}

/* One (token, KV head): returns 0, or -1 when a block id is outside the cache. Inlined with
 * constant `kv_bf16` and `NV` (16-float vectors per head) by attend() below, so that the
 * inner loops have neither a dtype branch nor a loop count to read. */
static inline __attribute__((always_inline)) int attend_as(const args_t *a, int64_t t, int64_t g,
                                                             const int kv_bf16, const int64_t NV) {
    const int64_t D = NV * W, G = a->H / a->KVH, BS = a->block_size;
    const int64_t out_base = (t * a->H + g * G) * D;
    int64_t row = a->token_row[t];
    int64_t n_keys = 0;
    if (row >= 0 && row < a->rows && a->seq_lens[row] > 0
        && t >= a->query_start[row] && t < a->query_start[row + 1]) {
        int64_t limit = a->positions[t];
        if (limit > a->seq_lens[row] - 1) limit = a->seq_lens[row] - 1;
        n_keys = limit + 1;
        if (n_keys > a->table_cols * BS) n_keys = a->table_cols * BS;
    }
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
            q[i][n] = load16(a->q, t * a->q_stride_t + (g * G + i) * a->q_stride_h + n * W, a->q_bf16) * a->scale;
            acc[i][n] = zero;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t key_stride = a->KVH * D; /* elements between consecutive slots */
    const int64_t elem = kv_bf16 ? 2 : 4;
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
        for (int64_t c0 = 0; c0 < nk; c0 += W) { /* scores, 16 keys at a time */
            int64_t nc = nk - c0 < W ? nk - c0 : W;
            for (int64_t jj = 0; jj < W; jj++) {
                if (jj < nc) {
                    for (int64_t n = 0; n < NV; n++)
                        key[n] = load16(a->k, first + (c0 + jj) * key_stride + n * W, kv_bf16);
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
                vf sums = reduce16(dots[i]);
                memcpy(&s[i][c0], &sums, sizeof sums);
            }
        }
        for (int64_t i = 0; i < G; i++) { /* online softmax: rescale what came before */
            float block_max = s[i][0];
            for (int64_t jj = 1; jj < nk; jj++) block_max = s[i][jj] > block_max ? s[i][jj] : block_max;
            float new_max = m[i] > block_max ? m[i] : block_max;
            float correction = m[i] == -INFINITY ? 0.0f : exp_nonpositive(m[i] - new_max);
            float sum = 0.0f;
            for (int64_t jj = 0; jj < nk; jj++) {
                s[i][jj] = exp_nonpositive(s[i][jj] - new_max);
                sum += s[i][jj];
            }
            l[i] = l[i] * correction + sum;
            m[i] = new_max;
            for (int64_t n = 0; n < NV; n++) acc[i][n] *= correction;
        }
        for (int64_t jj = 0; jj < nk; jj++) { /* weighted values */
            for (int64_t n = 0; n < NV; n++) key[n] = load16(a->v, first + jj * key_stride + n * W, kv_bf16);
            for (int64_t i = 0; i < G; i++) {
                float p = s[i][jj];
                for (int64_t n = 0; n < NV; n++) acc[i][n] += p * key[n];
            }
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float inv = 1.0f / l[i];
        for (int64_t n = 0; n < NV; n++) store16(a->out, out_base + i * D + n * W, acc[i][n] * inv, a->q_bf16);
    }
    return 0;
}

static int attend(const args_t *a, int64_t t, int64_t g) {
    const int64_t NV = a->D / W;
    if (a->kv_bf16) {
        if (NV == 4) return attend_as(a, t, g, 1, 4);
        if (NV == 8) return attend_as(a, t, g, 1, 8);
        return attend_as(a, t, g, 1, NV);
    }
    if (NV == 4) return attend_as(a, t, g, 0, 4);
    if (NV == 8) return attend_as(a, t, g, 0, 8);
    return attend_as(a, t, g, 0, NV);
}

static void *run_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const args_t *a = (const args_t *)p->args;
    for (int64_t w = p->lo; w < p->hi; w++)
        if (attend(a, w / a->KVH, w % a->KVH) != 0) p->status = -1;
    return NULL;
}

/* Returns 0; -1 when a block id lies outside the cache; -2 for shapes this kernel does not
 * take (the caller checks them first, so this is a last guard). `threads` splits the
 * (token, KV head) pairs when there are enough keys to pay for starting threads. */
int blink_paged_attention(const void *q, int64_t q_stride_t, int64_t q_stride_h, void *out, const void *k, const void *v, int q_bf16,
                          int kv_bf16, int64_t T, int64_t H, int64_t KVH, int64_t D,
                          int64_t block_size, int64_t num_blocks, int64_t rows,
                          const int64_t *token_row, const int64_t *positions,
                          const int32_t *query_start, const int32_t *seq_lens,
                          const int32_t *tables, int64_t table_stride, int64_t table_cols,
                          float scale, int64_t key_visits, int threads) {
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D % W != 0 || D > MAX_HEAD_DIM
        || block_size > MAX_BLOCK)
        return -2;
    args_t a = {q, q_stride_t, q_stride_h, out, k, v, q_bf16, kv_bf16, T, H, KVH, D, block_size, num_blocks, rows,
                token_row, positions, query_start, seq_lens, tables, table_stride, table_cols, scale};
    /* one thread per ~64K key visits (~0.1 ms of work) at most */
    while (threads > 1 && key_visits < ((int64_t)threads << 16)) threads--;
    return blink_run_parts(run_part, &a, T * KVH, threads);
}
