/* Fused bf16 elementwise ops for the eager CPU forward: each one call instead of 6-18 aten ops
 * (and, at the end, a replayed decode graph's step inputs in one call: blink_step_inputs).
 *
 * At a decode step's sizes (a few rows of 576-1536 channels) an aten op costs microseconds
 * of dispatch whatever it computes, and the torch references (kernels/reference/layers.py) spend
 * 6-18 ops per norm, rotary embedding or gated activation (~4.6 ms of a ~25 ms one-row
 * SmolLM2 step, measured by taking them out). Each function here is one pass with the reference's arithmetic: fp32 in
 * the same order, rounded to bf16 where the reference rounds (round to nearest even), so
 * the results are the reference's bits except where noted. Built at first use by
 * kernels/cpu/fused.py, with -ffp-contract=off so that a*b - c*d is not turned into a fused
 * multiply-add the reference does not do, and -fno-trapping-math so that the clamp and the
 * sign select in the SiLU vectorise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* With AVX512-BF16 the norms and the SiLU run 16 channels per step with intrinsics: the
 * compiler's own vectorisation of the scalar loops below left them at 1-2 ns per element
 * (an integer rounding sequence per bf16 and 8-lane vectors), slower than the matrix
 * products around them at prefill sizes. The vector code does the scalar code's arithmetic
 * in the same order (no fused multiply-add, per-lane sums as `lanes` below) and rounds with
 * vcvtneps2bf16, the same round-to-nearest-even, so the results are the scalar code's bits;
 * only fp32 denormals, which that instruction flushes to zero, could differ. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BLINK_VECTOR_OPS 1 /* load_bf16x16, round_bf16x16, silu_times16...: kernels.h */
#endif

#ifdef BLINK_VECTOR_OPS
/* 16 bf16 widened exactly to fp32; lanes outside `live` are 0 (not read). */
static inline __m512 widen_bf16x16(const uint16_t *p, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}
#endif

/* Whether this build runs the norms and the SiLU on AVX512-BF16 intrinsics (tests). */
int blink_has_vector_ops(void) {
#ifdef BLINK_VECTOR_OPS
    return 1;
#else
    return 0;
#endif
}

/* out[t] = bf16(weight * bf16(r * rsqrt(mean(r^2) + eps))) with r = x[t] (no residual) or
 * r = bf16(x[t] + residual[t]), which is also stored to residual_out[t]: the reference's
 * rms_norm / fused_add_rms_norm. x and residual rows are `x_stride` / `res_stride` apart,
 * the outputs contiguous. The sum of squares is fp32 in 16 lanes, so its last bit may
 * differ from torch's mean (a bf16 result differs at most where that bit rounds). */
static void add_rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                         int64_t res_stride, const uint16_t *weight, uint16_t *out,
                         uint16_t *residual_out, int64_t rows, int64_t dim, float eps) {
    enum { LANES = 16 };
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *xr = x + t * x_stride;
        uint16_t *o = out + t * dim;
        const uint16_t *r = xr;
        int64_t i = 0;
        if (residual != NULL) {
            const uint16_t *res = residual + t * res_stride;
            uint16_t *ro = residual_out + t * dim;
#ifdef BLINK_VECTOR_OPS
            for (; i + LANES <= dim; i += LANES)
                store_bf16x16(ro + i, _mm512_add_ps(load_bf16x16(xr + i), load_bf16x16(res + i)));
#endif
            for (; i < dim; i++) ro[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(res[i]));
            r = ro;
        }
        float lanes[LANES] = {0};
        i = 0;
#ifdef BLINK_VECTOR_OPS
        __m512 squares = _mm512_setzero_ps();
        for (; i + LANES <= dim; i += LANES) {
            const __m512 v = load_bf16x16(r + i);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        _mm512_storeu_ps(lanes, squares);
#else
        for (; i + LANES <= dim; i += LANES)
            for (int l = 0; l < LANES; l++) {
                float v = bf16_to_f32(r[i + l]);
                lanes[l] += v * v;
            }
#endif
        for (; i < dim; i++) {
            float v = bf16_to_f32(r[i]);
            lanes[0] += v * v;
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += lanes[l];
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        i = 0;
#ifdef BLINK_VECTOR_OPS
        const __m512 scale16 = _mm512_set1_ps(scale);
        for (; i + LANES <= dim; i += LANES)
            store_bf16x16(o + i, _mm512_mul_ps(load_bf16x16(weight + i),
                                               round_bf16x16(_mm512_mul_ps(load_bf16x16(r + i), scale16))));
#endif
        for (; i < dim; i++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(r[i]) * scale));
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
}

/* Neox-style rotary embedding of q [T, H, D] and k [T, KVH, D] (rows `q_stride` /
 * `k_stride` apart, heads contiguous) into out [T, H + KVH, D] (the reference's layout:
 * q heads then k heads); cos_sin [positions, rotary_dim] fp32, cos then sin. Channels past
 * rotary_dim are copied. Returns -1 if a position lies outside the table. Bit-exact. */
static int rope(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                const int64_t *positions, const float *cos_sin, int64_t max_positions,
                uint16_t *out, int64_t tokens, int64_t H, int64_t KVH, int64_t D, int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t pos = positions[t];
        if (pos < 0 || pos >= max_positions) return -1;
        const float *cos = cos_sin + pos * rotary_dim, *sin = cos + half;
        for (int64_t h = 0; h < H + KVH; h++) {
            const uint16_t *src = h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D;
            uint16_t *dst = out + (t * (H + KVH) + h) * D;
            int64_t i = 0;
#ifdef BLINK_VECTOR_OPS /* the loop below on 16 channels: the same products, sums and rounding */
            for (; i + 16 <= half; i += 16) {
                const __m512 x1 = load_bf16x16(src + i), x2 = load_bf16x16(src + i + half);
                const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
                store_bf16x16(dst + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
                store_bf16x16(dst + i + half, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
            }
#endif
            for (; i < half; i++) {
                float x1 = bf16_to_f32(src[i]), x2 = bf16_to_f32(src[i + half]);
                dst[i] = f32_to_bf16(x1 * cos[i] - x2 * sin[i]);
                dst[i + half] = f32_to_bf16(x2 * cos[i] + x1 * sin[i]);
            }
            if (rotary_dim < D) memcpy(dst + rotary_dim, src + rotary_dim, (size_t)(D - rotary_dim) * 2);
        }
    }
    return 0;
}

/* out[t] = bf16(bf16(silu(gate)) * up) for x[t] = [gate (dim) | up (dim)], rows `x_stride`
 * apart: the reference's F.silu(gate) * up in bf16. silu's exp is exp_nonpositive, so a result
 * may differ from torch's by one bf16 step where the fp32 value lies at a rounding edge. */
static void silu_and_mul_row(const uint16_t *restrict gate, const uint16_t *restrict up,
                             uint16_t *restrict o, int64_t dim) {
    int64_t i = 0;
#ifdef BLINK_VECTOR_OPS
    for (; i + 16 <= dim; i += 16) {
        store_bf16x16(o + i, silu_times16(load_bf16x16(gate + i), load_bf16x16(up + i)));
    }
#elif defined(BLINK_AVX2_EXP)
    for (; i + 8 <= dim; i += 8) {
        store_bf16x8(o + i, silu_times8(load_bf16x8(gate + i), load_bf16x8(up + i)));
    }
#endif
    for (; i < dim; i++) {
        float g = bf16_to_f32(gate[i]);
        /* silu_times16's arithmetic (kernels.h): (g < 0 ? g e : g) / (1 + e), e = exp(-|g|) */
        float e = exp_nonpositive(-fabsf(g));
        float silu = bf16_to_f32(f32_to_bf16((g < 0.0f ? g * e : g) / (1.0f + e)));
        o[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
    }
}

/* ---- The exported calls: rows split over `threads` when a call is large enough (16K
 * elements, ~5-10 us of work, per thread at least: a prefill's, and a decode step's from 32
 * rows), each part the functions above on its rows. */
enum { ELEMENTS_PER_THREAD = 1 << 14 };

typedef struct {
    const uint16_t *k, *v;
    int64_t k_stride, v_stride, row;
    uint16_t *k_cache, *v_cache;
    const int64_t *slot_mapping;
} kv_args_t;

static void *kv_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const kv_args_t *a = (const kv_args_t *)p->args;
    for (int64_t t = p->lo; t < p->hi; t++) {
        const int64_t slot = a->slot_mapping[t];
        memcpy(a->k_cache + slot * a->row, a->k + t * a->k_stride, (size_t)a->row * 2);
        memcpy(a->v_cache + slot * a->row, a->v + t * a->v_stride, (size_t)a->row * 2);
    }
    return NULL;
}

/* The new tokens' K and V rows ([T, KVH*D] each, rows `k_stride` / `v_stride` apart) into
 * the paged caches ([slots, KVH*D]) at slot_mapping. Returns -1, writing nothing, if a slot
 * lies outside the cache. Exact (a copy). A prefill's rows split over `threads`: its writes
 * mostly miss the caches (a prompt's new blocks), and two threads keep twice the misses in
 * flight (8.9 -> 5.2 ms of a 16 x 128 prefill). */
int blink_write_kv(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                   uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping,
                   int64_t tokens, int64_t row, int64_t slots, int threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= slots) return -1;
    const kv_args_t a = {k, v, k_stride, v_stride, row, k_cache, v_cache, slot_mapping};
    blink_run_parts(kv_part, &a, tokens, blink_threads_for(tokens * row, ELEMENTS_PER_THREAD, threads));
    return 0;
}

typedef struct {
    const uint16_t *x, *residual, *weight;
    int64_t x_stride, res_stride, dim;
    uint16_t *out, *residual_out;
    float eps;
} norm_args_t;

static void *norm_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const norm_args_t *a = (const norm_args_t *)p->args;
    const int64_t lo = p->lo;
    add_rms_norm(a->x + lo * a->x_stride, a->x_stride, a->residual ? a->residual + lo * a->res_stride : NULL,
                 a->res_stride, a->weight, a->out + lo * a->dim, a->residual_out ? a->residual_out + lo * a->dim : NULL,
                 p->hi - lo, a->dim, a->eps);
    return NULL;
}

void blink_add_rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                        int64_t res_stride, const uint16_t *weight, uint16_t *out,
                        uint16_t *residual_out, int64_t rows, int64_t dim, float eps, int threads) {
    const norm_args_t a = {x, residual, weight, x_stride, res_stride, dim, out, residual_out, eps};
    blink_run_parts(norm_part, &a, rows, blink_threads_for(rows * dim, ELEMENTS_PER_THREAD, threads));
}

typedef struct {
    const uint16_t *q, *k;
    int64_t q_stride, k_stride;
    const int64_t *positions;
    const float *cos_sin;
    int64_t max_positions, H, KVH, D, rotary_dim;
    uint16_t *out;
} rope_args_t;

static void *rope_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const rope_args_t *a = (const rope_args_t *)p->args;
    const int64_t lo = p->lo;
    p->status = rope(a->q + lo * a->q_stride, a->q_stride, a->k + lo * a->k_stride, a->k_stride, a->positions + lo,
                     a->cos_sin, a->max_positions, a->out + lo * (a->H + a->KVH) * a->D, p->hi - lo, a->H, a->KVH,
                     a->D, a->rotary_dim);
    return NULL;
}

int blink_rope(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
               const int64_t *positions, const float *cos_sin, int64_t max_positions,
               uint16_t *out, int64_t tokens, int64_t H, int64_t KVH, int64_t D, int64_t rotary_dim,
               int threads) {
    const rope_args_t a = {q, k, q_stride, k_stride, positions, cos_sin, max_positions, H, KVH, D, rotary_dim, out};
    return blink_run_parts(rope_part, &a, tokens,
                           blink_threads_for(tokens * (H + KVH) * D, ELEMENTS_PER_THREAD, threads));
}

/* x[j] of an fp32 row, or of a bf16 one widened to fp32 (exactly) */
static inline __attribute__((always_inline)) float row_value(const void *x, int64_t j, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
}

/* log(sum_j e^x[j]) of one fp32 row, as torch.logsumexp: its max m, then m + log(sum e^(x - m))
 * (kernels.h's exp, 16 lanes). A NaN gives NaN, a row of -inf -inf, a +inf +inf (torch's
 * results); the sum's order is not torch's, so the last bit may differ. With `argmax`, also
 * the index torch.argmax gives (the first NaN, else the first maximum), found in the first
 * pass over the row. `bf16`: the row is bf16, each value widened exactly to fp32 as it is read
 * (the fp32 row's results for the widened row, bit for bit). */
static inline __attribute__((always_inline)) float logsumexp_row_as(const void *x, int64_t n, int64_t *argmax,
                                                                    const int bf16) {
#ifdef BLINK_VECTOR_OPS
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 top = minus_inf, best = minus_inf; /* best: each lane's first maximum, at best_at */
    __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 v = bf16 ? _mm512_mask_mov_ps(minus_inf, live, widen_bf16x16((const uint16_t *)x + j, live))
                              : _mm512_mask_loadu_ps(minus_inf, live, (const float *)x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
        if (argmax != NULL) {
            const __mmask16 above = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, above, v);
            best_at = _mm512_mask_mov_epi32(best_at, above, at);
            at = _mm512_add_epi32(at, step);
        }
    }
    if (argmax != NULL) {
        if (nan) {
            int64_t j = 0;
            while (!isnan(row_value(x, j, bf16))) j++;
            *argmax = j;
        } else { /* the lowest index among the lanes holding the row's maximum */
            const __mmask16 tied = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
            *argmax = _mm512_mask_reduce_min_epi32(tied, best_at);
        }
    }
    if (nan) return NAN;
    const float m = _mm512_reduce_max_ps(top);
    if (isinf(m)) return m;
    const __m512 shift = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 v = bf16 ? _mm512_mask_mov_ps(shift, live, widen_bf16x16((const uint16_t *)x + j, live))
                              : _mm512_mask_loadu_ps(shift, live, (const float *)x + j);
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(v, shift));
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
    }
    return m + logf(_mm512_reduce_add_ps(sum));
#else
    float m = -INFINITY;
    int64_t first = 0;
    for (int64_t j = 0; j < n; j++) {
        const float v = row_value(x, j, bf16);
        if (isnan(v)) {
            if (argmax != NULL) *argmax = j;
            return NAN;
        }
        if (v > m) {
            m = v;
            first = j;
        }
    }
    if (argmax != NULL) *argmax = first;
    if (isinf(m)) return m;
    float sum = 0.0f;
    int64_t j = 0;
#if defined(BLINK_AVX2_EXP) /* 8 lanes (kernels.h's exp_nonpositive8) */
    const __m256 shift = _mm256_set1_ps(m);
    __m256 sums = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 v = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + j))), 16))
                              : _mm256_loadu_ps((const float *)x + j);
        sums = _mm256_add_ps(sums, exp_nonpositive8(_mm256_sub_ps(v, shift)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; j < n; j++) sum += exp_nonpositive(row_value(x, j, bf16) - m);
    return m + logf(sum);
#endif
}

static float logsumexp_row(const float *x, int64_t n, int64_t *argmax) { return logsumexp_row_as(x, n, argmax, 0); }

typedef struct {
    const uint16_t *x;
    int64_t x_stride, dim;
    uint16_t *out;
} silu_args_t;

static void *silu_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const silu_args_t *a = (const silu_args_t *)p->args;
    for (int64_t t = p->lo; t < p->hi; t++)
        silu_and_mul_row(a->x + t * a->x_stride, a->x + t * a->x_stride + a->dim, a->out + t * a->dim, a->dim);
    return NULL;
}

void blink_silu_and_mul(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t dim, int threads) {
    const silu_args_t a = {x, x_stride, dim, out};
    blink_run_parts(silu_part, &a, rows, blink_threads_for(rows * dim, ELEMENTS_PER_THREAD, threads));
}

typedef struct {
    const float *x;
    int64_t x_stride, cols;
    float *out;
    int64_t *argmax; /* NULL: the log-normaliser alone */
    float *logprob;  /* with argmax: x[argmax] - out, the greedy token's logprob */
    const uint16_t *x_bf16; /* or the rows in bf16 (x NULL) */
} logsumexp_args_t;

static void *logsumexp_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const logsumexp_args_t *a = (const logsumexp_args_t *)p->args;
    for (int64_t r = p->lo; r < p->hi; r++) {
        int64_t *at = a->argmax != NULL ? a->argmax + r : NULL;
        float value; /* x[argmax], for the logprob */
        if (a->x_bf16 != NULL) {
            const uint16_t *x = a->x_bf16 + r * a->x_stride;
            a->out[r] = logsumexp_row_as(x, a->cols, at, 1);
            value = at != NULL ? bf16_to_f32(x[*at]) : 0.0f;
        } else {
            const float *x = a->x + r * a->x_stride;
            a->out[r] = logsumexp_row(x, a->cols, at);
            value = at != NULL ? x[*at] : 0.0f;
        }
        if (a->logprob != NULL) a->logprob[r] = value - a->out[r]; /* the sampler's gather - log_norm */
    }
    return NULL;
}

/* out[r] = logsumexp of fp32 row r (rows x_stride apart): the sampler's log-normaliser. */
void blink_logsumexp_rows(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t cols, int threads) {
    const logsumexp_args_t a = {x, x_stride, cols, out, NULL, NULL, NULL};
    blink_run_parts(logsumexp_part, &a, rows, blink_threads_for(rows * cols, 16 * ELEMENTS_PER_THREAD, threads));
}

/* blink_logsumexp_rows (the same bits in out) and argmax[r] = torch.argmax of row r, from the
 * same first pass over the row, and logprob[r] = x[argmax[r]] - out[r] (fp32, as the sampler's
 * gather and subtraction): a greedy step's token, log-normaliser and the token's logprob. */
void blink_argmax_logsumexp_rows(const float *x, int64_t x_stride, int64_t *argmax, float *out, float *logprob,
                                 int64_t rows, int64_t cols, int threads) {
    const logsumexp_args_t a = {x, x_stride, cols, out, argmax, logprob, NULL};
    blink_run_parts(logsumexp_part, &a, rows, blink_threads_for(rows * cols, 16 * ELEMENTS_PER_THREAD, threads));
}

/* blink_argmax_logsumexp_rows of bf16 rows (x_stride elements apart), each value widened to fp32
 * as it is read: the fp32 call's bits for the widened rows, without writing them (a greedy
 * step's logits as the head leaves them). */
void blink_argmax_logsumexp_rows_bf16(const uint16_t *x, int64_t x_stride, int64_t *argmax, float *out, float *logprob,
                                      int64_t rows, int64_t cols, int threads) {
    const logsumexp_args_t a = {NULL, x_stride, cols, out, argmax, logprob, x};
    blink_run_parts(logsumexp_part, &a, rows, blink_threads_for(rows * cols, 16 * ELEMENTS_PER_THREAD, threads));
}

typedef struct {
    const float *x;
    int64_t x_stride;
    const uint32_t *words;
    int64_t w_stride, n_words;
    const int64_t *slot;
    const uint8_t *mode;
    int64_t cols;
    float *out;
} token_mask_args_t;

static void *token_mask_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const token_mask_args_t *a = (const token_mask_args_t *)p->args;
    const float neg_inf = -__builtin_inff();
    for (int64_t r = p->lo; r < p->hi; r++) {
        const float *x = a->x + r * a->x_stride;
        float *o = a->out + r * a->cols;
        if (a->mode[r] == 0) {  /* unconstrained: as it is */
            memcpy(o, x, (size_t)a->cols * sizeof(float));
            continue;
        }
        if (a->mode[r] == 2) {  /* its mask has not arrived: nothing is allowed */
            for (int64_t c = 0; c < a->cols; c++) o[c] = neg_inf;
            continue;
        }
        const uint32_t *w = a->words + a->slot[r] * a->w_stride;
        const int64_t covered = a->n_words * 32 < a->cols ? a->n_words * 32 : a->cols;
        for (int64_t c = 0; c < covered; c++) o[c] = ((w[c >> 5] >> (c & 31)) & 1u) ? x[c] : neg_inf;
        for (int64_t c = covered; c < a->cols; c++) o[c] = neg_inf;
    }
    return NULL;
}

/* out[r] = logits row r with the tokens its slot's packed mask forbids set to -inf (mode 1),
 * copied (mode 0), or all -inf (mode 2): the sampler's structured-output mask
 * (blink.kernels.reference.mask.apply_token_mask). One pass per row. */
void blink_token_mask_rows(const float *x, int64_t x_stride, const uint32_t *words, int64_t w_stride,
                           int64_t n_words, const int64_t *slot, const uint8_t *mode, float *out,
                           int64_t rows, int64_t cols, int threads) {
    const token_mask_args_t a = {x, x_stride, words, w_stride, n_words, slot, mode, cols, out};
    blink_run_parts(token_mask_part, &a, rows, blink_threads_for(rows * cols, ELEMENTS_PER_THREAD, threads));
}

/* A CPU graph's inputs for one decode step (blink/decode_graphs.py): the n tokens' embedding
 * rows, their positions, slots and rows, the r rows' query starts, lengths and block tables,
 * copied into the graph's buffers of `tokens` tokens and rows, the rest padding (position 0,
 * a slot of the scratch block, rows with no tokens and no context), as the torch code's index
 * select, six copies and four fills do, in one call. Also whether `logits_indices` (k of them)
 * are 0 .. k - 1, a decode step's own order. */
typedef struct {
    const uint8_t *table;  /* the embedding: table_rows rows of row_bytes, table_stride bytes apart */
    int64_t table_rows, row_bytes, table_stride;
    const int64_t *ids;
    uint8_t *embedded;     /* rows of row_bytes, contiguous */
    const int64_t *positions_src, *slots_src, *seq_idx_src, *pad_slots;
    int64_t *positions, *slots, *seq_idx;
    const int32_t *query_start_src, *seq_lens_src, *tables_src;
    int32_t *query_start, *seq_lens, *tables;
    int64_t n, tokens, r, width, tables_src_stride, tables_stride;
    const int64_t *logits_indices;
    int64_t k;
} blink_step_inputs_t;

int64_t blink_step_inputs_size(void) { return (int64_t)sizeof(blink_step_inputs_t); }

/* Returns -1 for a token id outside the embedding (nothing is written past the ids checked
 * before it), else 1 when the logits indices are in order and 0 when not. */
int blink_step_inputs(const blink_step_inputs_t *s) {
    for (int64_t i = 0; i < s->n; i++) {
        const int64_t id = s->ids[i];
        if (id < 0 || id >= s->table_rows) return -1;
        memcpy(s->embedded + i * s->row_bytes, s->table + id * s->table_stride, (size_t)s->row_bytes);
    }
    memcpy(s->positions, s->positions_src, (size_t)s->n * sizeof(int64_t));
    memcpy(s->slots, s->slots_src, (size_t)s->n * sizeof(int64_t));
    memcpy(s->seq_idx, s->seq_idx_src, (size_t)s->n * sizeof(int64_t));
    for (int64_t i = s->n; i < s->tokens; i++) {
        s->positions[i] = 0;
        s->slots[i] = s->pad_slots[i];
    }
    memcpy(s->query_start, s->query_start_src, (size_t)(s->r + 1) * sizeof(int32_t));
    memcpy(s->seq_lens, s->seq_lens_src, (size_t)s->r * sizeof(int32_t));
    for (int64_t i = 0; i < s->r; i++)
        memcpy(s->tables + i * s->tables_stride, s->tables_src + i * s->tables_src_stride,
               (size_t)s->width * sizeof(int32_t));
    for (int64_t i = s->r; i < s->tokens; i++) {
        s->query_start[i + 1] = (int32_t)s->n;
        s->seq_lens[i] = 0;
    }
    for (int64_t i = 0; i < s->k; i++)
        if (s->logits_indices[i] != i) return 0;
    return 1;
}
