/* The sampler's penalties, seeded draw and top-k / top-p / min-p filter for fp32 CPU logits: the
 * C twins of kernels/reference/sampling.py's `apply_penalties`, `sample` and
 * `apply_top_k_top_p_min_p` (the rules and the RNG bits are specified there;
 * kernels/triton/sampling.py is the GPU twin of the draw and the filter).
 *
 * Why: the references are torch code over the whole vocabulary. At one row of SmolLM2's 49152
 * entries the draw (a hash in ~20 int64 ops, two logs) took ~0.8 ms and the filter (a full stable
 * sort, a softmax, a cumsum, a scatter) ~3.9 ms, against a ~2.4 ms forward
 * (docs/performance.md#cpu-sampler).
 *
 * The draw: token = argmax(x[v] + g[v]) with Gumbel noise g = -log(-log(u)), u the counter-based
 * uniform. g lies in [-2.82, 16.64] (u in [2^-24, 1 - 2^-24]), so once one entry's score s is
 * known, an entry with x[v] < s - GUMBEL_SPAN cannot beat it: only the rows' top entries get a
 * hash and two logs (s: the top entry's score; a floor raised by every score found on the way
 * saved nothing measurable: a 16-lane block is scored whole once one lane is near). Same tokens
 * as the reference except where two scores are within an ulp of the log (its log is Sleef's,
 * this one Cephes' polynomial, both within ~1 ulp).
 *
 * The filter finds the reference's cut-offs without sorting the row: entries fall into buckets
 * of 1/64 nat below the row's maximum (2048 of them: 32 nats; then one bucket for everything
 * farther, -inf included), whose counts give the bucket holding the k-th largest value and whose
 * masses the bucket where the mass ranked above reaches top_p; only that bucket's entries are
 * sorted (value descending, index ascending: the reference's stable sort). Same survivors as the
 * reference except where a mass lies within rounding of top_p or exp(x - max) within rounding of
 * min_p (the sums are added in another order, the exp is kernels.h's), as for the Triton twin.
 *
 * The penalties (repetition, frequency, presence) change only the tokens of the row's history:
 * the reference counts them in a [B, V] scatter and rewrites the whole vocabulary in ~10 ops.
 *
 * Built by kernels/cpu/sampling.py with -ffp-contract=off: the vector and scalar logs below do
 * the same operations in the same order, so a lane and the scalar tail give the same bits.
 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* ---------------------------------------------------------------------------------- RNG */

#define SEED_SALT 0x243F6A88u
#define FMIX_C1 0x85EBCA6Bu
#define FMIX_C2 0xC2B2AE35u
#define GOLDEN 0x9E3779B9u

static inline uint32_t fmix32(uint32_t h) { /* murmur3's finaliser; uint32 products wrap as mul32 */
    h ^= h >> 16;
    h *= FMIX_C1;
    h ^= h >> 13;
    h *= FMIX_C2;
    return h ^ (h >> 16);
}

static uint32_t row_key(int64_t seed, int64_t counter) {
    const uint64_t s = (uint64_t)seed, c = (uint64_t)counter;
    uint32_t k = fmix32((uint32_t)s ^ SEED_SALT);
    k = fmix32(k ^ (uint32_t)(s >> 32));
    k = fmix32(k ^ (uint32_t)c);
    return fmix32(k ^ (uint32_t)(c >> 32));
}

static inline float uniform_of(uint32_t key, uint32_t v) {
    const uint32_t bits = fmix32(key ^ (v * GOLDEN));
    return (float)(((bits >> 9) << 1) + 1u) * 0x1p-24f; /* exact: an integer below 2^24, a power of 2 */
}

/* ---------------------------------------------------------------------------------- log */

/* log(x) for positive normal x: Cephes' logf (x = m 2^e with m in [sqrt(1/2), sqrt(2)), a
 * degree-8 polynomial in m - 1; ~1 ulp). Scalar and vector code below: the same operations. */
#define LOG_P8 7.0376836292e-2f
#define LOG_P7 -1.1514610310e-1f
#define LOG_P6 1.1676998740e-1f
#define LOG_P5 -1.2420140846e-1f
#define LOG_P4 1.4249322787e-1f
#define LOG_P3 -1.6668057665e-1f
#define LOG_P2 2.0000714765e-1f
#define LOG_P1 -2.4999993993e-1f
#define LOG_P0 3.3333331174e-1f
#define LOG_Q1 -2.12194440e-4f
#define LOG_Q2 0.693359375f
#define SQRT2 1.41421356237f

static inline float log_positive(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    float e = (float)((int32_t)(bits >> 23) - 127);
    bits = (bits & 0x007FFFFFu) | 0x3F800000u; /* the mantissa in [1, 2) */
    float m;
    memcpy(&m, &bits, sizeof m);
    if (m > SQRT2) {
        m = m * 0.5f;
        e = e + 1.0f;
    }
    const float f = m - 1.0f, z = f * f;
    float p = LOG_P8;
    p = p * f + LOG_P7;
    p = p * f + LOG_P6;
    p = p * f + LOG_P5;
    p = p * f + LOG_P4;
    p = p * f + LOG_P3;
    p = p * f + LOG_P2;
    p = p * f + LOG_P1;
    p = p * f + LOG_P0;
    float y = p * f * z;
    y = y + e * LOG_Q1;
    y = y - 0.5f * z;
    return (f + y) + e * LOG_Q2;
}

/* -log(-log(u)): the reference's gumbel_noise, one entry */
static inline float gumbel_of(uint32_t key, uint32_t v) { return -log_positive(-log_positive(uniform_of(key, v))); }

#if defined(__AVX512F__)
static inline __m512i fmix32x16(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)FMIX_C1));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)FMIX_C2));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

static inline __m512 log_positive16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007FFFFF)),
                                                   _mm512_set1_epi32(0x3F800000)));
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(SQRT2), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(f, f);
    __m512 p = _mm512_set1_ps(LOG_P8);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P7));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P6));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P5));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(LOG_P0));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
    y = _mm512_add_ps(y, _mm512_mul_ps(e, _mm512_set1_ps(LOG_Q1)));
    y = _mm512_sub_ps(y, _mm512_mul_ps(_mm512_set1_ps(0.5f), z));
    return _mm512_add_ps(_mm512_add_ps(f, y), _mm512_mul_ps(e, _mm512_set1_ps(LOG_Q2)));
}

/* gumbel_of for entries v .. v + 15 */
static inline __m512 gumbel16(uint32_t key, uint32_t v) {
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)v),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i bits = fmix32x16(_mm512_xor_si512(_mm512_set1_epi32((int)key),
                                                    _mm512_mullo_epi32(index, _mm512_set1_epi32((int)GOLDEN))));
    const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(bits, 9), 1), _mm512_set1_epi32(1));
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(0x1p-24f));
    const __m512 minus_zero = _mm512_set1_ps(-0.0f);
    return _mm512_xor_ps(log_positive16(_mm512_xor_ps(log_positive16(u), minus_zero)), minus_zero);
}
#endif

/* ---------------------------------------------------------------------------------- a row's maximum */

/* The largest entry of a row (-inf for an empty or all -inf row; a NaN does not count) and
 * whether it holds a NaN: the first pass of the draw, the filter and the prompt logprobs. */
static float row_max(const float *x, int64_t n, int *any_nan) {
    float top = -INFINITY;
    int nan = 0;
    int64_t v = 0;
#if defined(__AVX512F__)
    __m512 tops = _mm512_set1_ps(-INFINITY);
    __mmask16 nans = 0;
    for (; v + 16 <= n; v += 16) {
        const __m512 xs = _mm512_loadu_ps(x + v);
        nans |= _mm512_cmp_ps_mask(xs, xs, _CMP_UNORD_Q);
        tops = _mm512_max_ps(xs, tops); /* a NaN lane of xs keeps tops' (vmaxps returns its second operand) */
    }
    nan = nans != 0;
    top = _mm512_reduce_max_ps(tops);
#endif
    for (; v < n; v++) {
        nan |= isnan(x[v]);
        if (x[v] > top) top = x[v];
    }
    *any_nan = nan;
    return top;
}

/* The first index v with x[v] == value (or, for a NaN value, the first NaN); n if none. */
static int64_t first_at(const float *x, int64_t n, float value) {
    int64_t v = 0;
    const int want_nan = isnan(value);
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(value);
    for (; v + 16 <= n; v += 16) {
        const __m512 xs = _mm512_loadu_ps(x + v);
        const __mmask16 hit = want_nan ? _mm512_cmp_ps_mask(xs, xs, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(xs, target, _CMP_EQ_OQ);
        if (hit) return v + __builtin_ctz(hit);
    }
#endif
    for (; v < n; v++)
        if (want_nan ? isnan(x[v]) : x[v] == value) return v;
    return n;
}

/* ---------------------------------------------------------------------------------- the draw */

/* The largest Gumbel noise this code computes (u = 1 - 2^-24: 16.636), with room for rounding:
 * an entry whose logit is more than this below a known score cannot win. */
#define GUMBEL_SPAN 17.0f

/* The reference's sample() of one row: argmax(x + g), the first index among equal scores; a
 * NaN logit wins (the first one), as torch.argmax takes NaN for the maximum. */
static int64_t sample_row(const float *x, int64_t n, uint32_t key) {
    int any_nan;
    const float largest = row_max(x, n, &any_nan);
    if (any_nan) return first_at(x, n, NAN);
    const int64_t top = first_at(x, n, largest); /* the first maximum: a score to beat */
    if (isinf(x[top])) return top; /* all -inf: index 0; +inf: the first +inf scores +inf */
    const float floor = x[top] + gumbel_of(key, (uint32_t)top) - GUMBEL_SPAN; /* entries below cannot win */
    float best = -INFINITY;
    int64_t best_at = top;
    int64_t v = 0;
#if defined(__AVX512F__)
    const __m512 below = _mm512_set1_ps(floor);
    __m512 lane_best = _mm512_set1_ps(-INFINITY);
    __m512i lane_at = _mm512_setzero_si512();
    for (; v + 16 <= n; v += 16) {
        const __m512 xs = _mm512_loadu_ps(x + v);
        const __mmask16 near = _mm512_cmp_ps_mask(xs, below, _CMP_GE_OQ);
        if (near == 0) continue;
        const __m512 score = _mm512_add_ps(xs, gumbel16(key, (uint32_t)v));
        const __mmask16 better = _mm512_mask_cmp_ps_mask(near, score, lane_best, _CMP_GT_OQ);
        lane_best = _mm512_mask_mov_ps(lane_best, better, score);
        lane_at = _mm512_mask_mov_epi32(lane_at, better, _mm512_add_epi32(
            _mm512_set1_epi32((int)v), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
    }
    best = _mm512_reduce_max_ps(lane_best);
    if (best > -INFINITY) {
        const __mmask16 tied = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_at = _mm512_mask_reduce_min_epi32(tied, lane_at);
    }
#endif
    for (; v < n; v++) {
        if (!(x[v] >= floor)) continue;
        const float score = x[v] + gumbel_of(key, (uint32_t)v);
        if (score > best) {  /* later entries only win by more: the vector part's indices are lower */
            best = score;
            best_at = v;
        }
    }
    return best_at;
}

typedef struct {
    const float *x;
    int64_t x_stride, cols;
    const int64_t *seeds, *counters;
    int64_t *out;
} sample_args_t;

static void *sample_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const sample_args_t *a = (const sample_args_t *)p->args;
    for (int64_t r = p->lo; r < p->hi; r++)
        a->out[r] = sample_row(a->x + r * a->x_stride, a->cols, row_key(a->seeds[r], a->counters[r]));
    return NULL;
}

/* out[r] = the reference's sample() of row r of x (rows x_stride apart, cols < 2^31), keyed by
 * seeds[r], counters[r]. */
void blink_sample_rows(const float *x, int64_t x_stride, const int64_t *seeds, const int64_t *counters, int64_t *out,
                       int64_t rows, int64_t cols, int threads) {
    const sample_args_t a = {x, x_stride, cols, seeds, counters, out};
    blink_run_parts(sample_part, &a, rows, blink_threads_for(rows, 1, threads));
}

/* out[r, v] = the reference's uniform(seeds[r], counters[r], v) (the RNG's bits, for tests). */
void blink_uniform_rows(const int64_t *seeds, const int64_t *counters, float *out, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t key = row_key(seeds[r], counters[r]);
        for (int64_t v = 0; v < cols; v++) out[r * cols + v] = uniform_of(key, (uint32_t)v);
    }
}

/* out[r, v] = -log(-log(uniform)) as the draw computes it (tests hold it to torch's log). */
void blink_gumbel_rows(const int64_t *seeds, const int64_t *counters, float *out, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t key = row_key(seeds[r], counters[r]);
        int64_t v = 0;
#if defined(__AVX512F__)
        for (; v + 16 <= cols; v += 16) _mm512_storeu_ps(out + r * cols + v, gumbel16(key, (uint32_t)v));
#endif
        for (; v < cols; v++) out[r * cols + v] = gumbel_of(key, (uint32_t)v);
    }
}

/* ---------------------------------------------------------------------------------- top k */

/* Keeps `value` (entry `index`) among the top_n largest so far, top_lp descending (an equal value
 * after the ones there: entries come in index order, so ties keep the lower index first). */
static inline void keep_top(float value, int64_t index, int64_t top_n, int64_t *filled, float *top_lp,
                            int64_t *top_ids) {
    if (top_n == 0 || (*filled == top_n && !(value > top_lp[top_n - 1]))) return;
    int64_t j = *filled < top_n ? (*filled)++ : top_n - 1;
    for (; j > 0 && value > top_lp[j - 1]; j--) {
        top_lp[j] = top_lp[j - 1];
        top_ids[j] = top_ids[j - 1];
    }
    top_lp[j] = value;
    top_ids[j] = index;
}

/* The k largest of one fp32 row with their ids, largest first (ties: the lower index first): the
 * sampler's top logprobs, from its raw logits. */
static void top_row(const float *x, int64_t n, int64_t k, float *values, int64_t *ids) {
    int64_t filled = 0, v = 0;
#if defined(__AVX512F__)
    for (; v + 16 <= n; v += 16) {
        const __m512 xs = _mm512_loadu_ps(x + v);
        __mmask16 above = k == 0       ? (__mmask16)0
                          : filled < k ? (__mmask16)0xFFFF
                                       : _mm512_cmp_ps_mask(xs, _mm512_set1_ps(values[k - 1]), _CMP_GT_OQ);
        for (; above; above &= above - 1) {
            const int lane = __builtin_ctz(above);
            keep_top(x[v + lane], v + lane, k, &filled, values, ids);
        }
    }
#endif
    for (; v < n; v++) keep_top(x[v], v, k, &filled, values, ids);
}

typedef struct {
    const float *x;
    int64_t x_stride, cols, k;
    float *values;
    int64_t *ids;
} top_args_t;

static void *top_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const top_args_t *a = (const top_args_t *)p->args;
    for (int64_t r = p->lo; r < p->hi; r++)
        top_row(a->x + r * a->x_stride, a->cols, a->k, a->values + r * a->k, a->ids + r * a->k);
    return NULL;
}

/* values, ids (rows x k, contiguous) = torch.topk of each fp32 row of x (rows x_stride apart, a
 * row without NaN; k <= cols): the k largest, largest first, ties in index order. */
void blink_top_rows(const float *x, int64_t x_stride, int64_t k, float *values, int64_t *ids, int64_t rows,
                    int64_t cols, int threads) {
    const top_args_t a = {x, x_stride, cols, k, values, ids};
    blink_run_parts(top_part, &a, rows, blink_threads_for(rows * cols, 1 << 16, threads));
}

/* ---------------------------------------------------------------------------------- prompt logprobs */

/* One prompt position of the reference's prompt_logprobs: lp = (x - max) - log(sum e^(x - max))
 * as torch's log_softmax takes it (kernels.h's exp: the sum's last bits may differ), the target's
 * lp, its rank (how many lp are >= it, itself included) and the top_n largest lp with their ids
 * (value descending, then index ascending; equal logprobs from different logits: the larger
 * logit first). */
static void prompt_logprob_row(const float *x, int64_t n, int64_t target, int64_t top_n, float *chosen, int64_t *rank,
                               float *top_lp, int64_t *top_ids) {
    int any_nan;
    const float top = row_max(x, n, &any_nan); /* a NaN makes the sum and every logprob NaN, as torch's */
    int64_t v = 0;
    double sum = 0.0; /* a double where the terms come one by one: a float summed 49K terms to ~1e-4 */
#if defined(__AVX512F__)
    {
        const __m512 shift = _mm512_set1_ps(top);
        __m512 sums = _mm512_setzero_ps();
        for (; v + 16 <= n; v += 16)
            sums = _mm512_add_ps(sums, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + v), shift)));
        sum = _mm512_reduce_add_ps(sums);
    }
#endif
    for (; v < n; v++) sum += exp_nonpositive(x[v] - top);
    const float log_sum = logf((float)sum);
    const float lp = (x[target] - top) - log_sum;
    *chosen = lp;

    int64_t at_least = 0;
    v = 0;
#if defined(__AVX512F__)
    {
        const __m512 shift = _mm512_set1_ps(top), log_sum16 = _mm512_set1_ps(log_sum), lp16 = _mm512_set1_ps(lp);
        for (; v + 16 <= n; v += 16) {
            const __m512 lps = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + v), shift), log_sum16);
            at_least += __builtin_popcount(_mm512_cmp_ps_mask(lps, lp16, _CMP_GE_OQ));
        }
    }
#endif
    for (; v < n; v++) at_least += (x[v] - top) - log_sum >= lp;
    /* the top_n by logit are the top_n by logprob (x -> (x - top) - log_sum never reorders) */
    top_row(x, n, top_n, top_lp, top_ids);
    for (int64_t j = 0; j < top_n; j++) top_lp[j] = (top_lp[j] - top) - log_sum;
    *rank = at_least;
}

typedef struct {
    const float *x;
    int64_t x_stride, cols, top_n;
    const int64_t *targets;
    float *chosen;
    int64_t *rank;
    float *top_lp;
    int64_t *top_ids;
} prompt_args_t;

static void *prompt_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const prompt_args_t *a = (const prompt_args_t *)p->args;
    for (int64_t r = p->lo; r < p->hi; r++)
        prompt_logprob_row(a->x + r * a->x_stride, a->cols, a->targets[r], a->top_n, a->chosen + r, a->rank + r,
                           a->top_lp + r * a->top_n, a->top_ids + r * a->top_n);
    return NULL;
}

/* Rows of the reference's prompt_logprobs: fp32 logits x (rows x_stride apart), targets[r] in
 * [0, cols); chosen[r], rank[r] and the top_n (top_lp, top_ids: rows x top_n, contiguous). */
void blink_prompt_logprobs_rows(const float *x, int64_t x_stride, const int64_t *targets, int64_t top_n, float *chosen,
                                int64_t *rank, float *top_lp, int64_t *top_ids, int64_t rows, int64_t cols,
                                int threads) {
    const prompt_args_t a = {x, x_stride, cols, top_n, targets, chosen, rank, top_lp, top_ids};
    blink_run_parts(prompt_part, &a, rows, blink_threads_for(rows * cols, 1 << 16, threads));
}

/* ---------------------------------------------------------------------------------- scratch */

typedef struct {
    float x, e;
    int32_t at;
} entry_t;

/* One part's per-entry facts for the filter and marks for the penalties. A slot per part that
 * can run at once, grown by blink_sampling_reserve (called from Python when a call needs more:
 * a larger vocabulary, more threads), so that the calls themselves never allocate: a fresh
 * allocation a call would also fault its pages in again each time. */
typedef struct {
    int64_t capacity;
    uint16_t *bucket;
    float *weight;
    int32_t *near; /* the filter's entries in buckets below FIRST, in index order */
    entry_t *entries;
    int32_t *marks; /* the penalties' marks, one per vocabulary entry, all 0 between calls */
} scratch_t;

static scratch_t slots[BLINK_MAX_THREADS];
static int slot_busy[BLINK_MAX_THREADS];
static int reserved_slots;

static scratch_t *take_slot(int i) { /* waits while another part holds slot i */
    while (__atomic_exchange_n(&slot_busy[i], 1, __ATOMIC_ACQUIRE)) sched_yield();
    return &slots[i];
}

static void give_back(const scratch_t *s) { __atomic_store_n(&slot_busy[s - slots], 0, __ATOMIC_RELEASE); }

/* A free slot (waiting for one if every reserved slot is taken: two engines' calls at once). */
static scratch_t *claim(void) {
    for (;;) {
        const int n = __atomic_load_n(&reserved_slots, __ATOMIC_ACQUIRE);
        for (int i = 0; i < n; i++)
            if (!__atomic_exchange_n(&slot_busy[i], 1, __ATOMIC_ACQUIRE)) return &slots[i];
        sched_yield();
    }
}

static void release_memory(scratch_t *s) {
    free(s->bucket);
    free(s->weight);
    free(s->near);
    free(s->entries);
    free(s->marks);
}

/* At least `count` slots (at most BLINK_MAX_THREADS) of at least `n` entries each. Returns 0, or
 * -1 where memory ran out (every slot keeps what it had, so the slots already reserved stay
 * usable at their size). */
int blink_sampling_reserve(int64_t n, int count) {
    if (count > BLINK_MAX_THREADS) count = BLINK_MAX_THREADS;
    for (int i = 0; i < count; i++) {
        scratch_t *s = take_slot(i);
        int failed = 0;
        if (s->capacity < n) {
            scratch_t grown = {n,
                               (uint16_t *)malloc((size_t)n * sizeof(uint16_t)),
                               (float *)malloc((size_t)n * sizeof(float)),
                               (int32_t *)malloc((size_t)n * sizeof(int32_t)),
                               (entry_t *)malloc((size_t)n * sizeof(entry_t)),
                               (int32_t *)calloc((size_t)n, sizeof(int32_t))};
            failed = grown.bucket == NULL || grown.weight == NULL || grown.near == NULL || grown.entries == NULL
                     || grown.marks == NULL;
            release_memory(failed ? &grown : s);
            if (!failed) *s = grown;
        }
        give_back(s);
        if (failed) return -1;
        if (i + 1 > __atomic_load_n(&reserved_slots, __ATOMIC_ACQUIRE))
            __atomic_store_n(&reserved_slots, i + 1, __ATOMIC_RELEASE);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- penalties */

enum { SEEN = 1 << 30, COUNT = SEEN - 1 }; /* a token's mark: in the row's history; its count in the output */

/* One row of the reference's apply_penalties: every entry gets (x - f*0) - p*0 (the reference's
 * arithmetic on tokens it does not touch: a -0.0 logit turns +0.0 under a negative penalty), and
 * the history's tokens the penalties themselves. Reads only the row's history, not its vocabulary's
 * worth of counts. `marks`: n zeros, zeros again on return. */
static void penalties_row(const float *x, float *out, int64_t n, const int32_t *ids, int64_t length, int64_t prompt,
                          int64_t total, float rep, float pres, float freq, int32_t *marks) {
    const float f0 = freq * 0.0f, p0 = pres * 0.0f;
    for (int64_t v = 0; v < n; v++) out[v] = (x[v] - f0) - p0;
    const int64_t end = total < length ? total : length;
    for (int64_t t = 0; t < end; t++) {
        const int32_t id = ids[t];
        if (id < 0 || id >= n) continue; /* padding (-1) and ids outside the vocabulary */
        marks[id] |= SEEN;
        if (t >= prompt) marks[id]++;
    }
    for (int64_t t = 0; t < end; t++) {
        const int32_t id = ids[t];
        if (id < 0 || id >= n || marks[id] == 0) continue; /* done already */
        float value = x[id];
        value = value > 0.0f ? value / rep : value * rep;
        const float count = (float)(marks[id] & COUNT);
        value = value - freq * count;
        value = value - pres * (count > 0.0f ? 1.0f : 0.0f);
        out[id] = value;
        marks[id] = 0;
    }
}

typedef struct {
    const float *x;
    int64_t x_stride, cols;
    const int32_t *ids;
    int64_t ids_stride, length;
    const int64_t *prompt_lens, *total_lens;
    const float *rep, *pres, *freq;
    float *out;
} penalties_args_t;

static void *penalties_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const penalties_args_t *a = (const penalties_args_t *)p->args;
    scratch_t *s = claim();
    for (int64_t r = p->lo; r < p->hi; r++)
        penalties_row(a->x + r * a->x_stride, a->out + r * a->cols, a->cols, a->ids + r * a->ids_stride, a->length,
                      a->prompt_lens[r], a->total_lens[r], a->rep[r], a->pres[r], a->freq[r], s->marks);
    give_back(s);
    return NULL;
}

/* out (rows x cols, contiguous) = the reference's apply_penalties of x (rows x_stride apart) with
 * the token history ids (rows ids_stride apart, `length` each: prompt then output, -1 padding),
 * prompt_lens, total_lens and the rows' repetition, presence and frequency penalties. Needs
 * blink_sampling_reserve(cols, threads) first. */
void blink_penalties_rows(const float *x, int64_t x_stride, const int32_t *ids, int64_t ids_stride, int64_t length,
                          const int64_t *prompt_lens, const int64_t *total_lens, const float *rep, const float *pres,
                          const float *freq, float *out, int64_t rows, int64_t cols, int threads) {
    const penalties_args_t a = {x, x_stride, cols, ids, ids_stride, length, prompt_lens, total_lens, rep, pres, freq,
                                out};
    blink_run_parts(penalties_part, &a, rows, blink_threads_for(rows, 1, threads));
}

/* ---------------------------------------------------------------------------------- the filter */

enum {
    PER_NAT = 64,          /* buckets per nat below the row's maximum */
    NEAR = 2048,           /* buckets 0 .. NEAR - 1 cover 32 nats */
    FAR = NEAR,            /* the last bucket: farther, and -inf */
    BUCKETS = NEAR + 1,
    FIRST = 8 * PER_NAT,   /* the entries within 8 nats are listed on the way: most rows' cuts are there */
};

/* The bucket of x in a row whose maximum is `top` (finite): 1/64 nat wide, nearest first;
 * monotone in x (a larger x never lands in a later bucket), -inf in FAR. */
static inline int bucket_of(float top, float x) {
    const float d = (top - x) * (float)PER_NAT;
    return d < (float)NEAR ? (int)d : FAR;
}

/* exp(x - top) as min-p and top-p see it: kernels.h's exp; 0 for -inf (the reference's exp) */
static inline float weight_of(float top, float x) { return x == -INFINITY ? 0.0f : exp_nonpositive(x - top); }

static int by_value_then_index(const void *pa, const void *pb) { /* descending value, ascending index */
    const entry_t *a = (const entry_t *)pa, *b = (const entry_t *)pb;
    if (a->x != b->x) return a->x > b->x ? -1 : 1;
    return (a->at > b->at) - (a->at < b->at);
}

/* The entries of bucket b that pass x >= floor and weight >= min_p, sorted (value descending,
 * index ascending), from the near list when b < FIRST, else from the whole row; their count. */
static int64_t collect(const float *x, int64_t n, const scratch_t *s, int64_t n_near, int b, float floor, float min_p) {
    int64_t m = 0;
    const int64_t count = b < FIRST ? n_near : n;
    for (int64_t j = 0; j < count; j++) {
        const int64_t v = b < FIRST ? s->near[j] : j;
        if (s->bucket[v] == b && x[v] >= floor && s->weight[v] >= min_p)
            s->entries[m++] = (entry_t){x[v], s->weight[v], (int32_t)v};
    }
    qsort(s->entries, (size_t)m, sizeof *s->entries, by_value_then_index);
    return m;
}

/* One row of the reference's apply_top_k_top_p_min_p, with a slot of n entries. A row holding a
 * NaN or +inf is copied unfiltered (the reference's sort and softmax give it no meaning either:
 * it masks every entry; the draw then takes the first NaN or +inf, as torch.argmax would). */
static void filter_row(const float *x, float *out, int64_t n, int64_t top_k, float top_p, float min_p, scratch_t *s) {
    int any_nan;
    const float top = row_max(x, n, &any_nan);
    int64_t v;
    if (any_nan || top == INFINITY) {
        memcpy(out, x, (size_t)n * sizeof *out);
        return;
    }
    if (top == -INFINITY) { /* the reference: exp(-inf - -inf) is NaN, which no min_p keeps */
        for (v = 0; v < n; v++) out[v] = -INFINITY;
        return;
    }

    /* Each entry's bucket and weight; the near list; the mass min-p keeps. */
    int64_t n_near = 0;
    double kept_mass = 0.0;
    v = 0;
#if defined(__AVX512F__)
    {
        const __m512 top16 = _mm512_set1_ps(top), minus_inf = _mm512_set1_ps(-INFINITY), floor16 = _mm512_set1_ps(min_p);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 mass = _mm512_setzero_ps();
        for (; v + 16 <= n; v += 16) {
            const __m512 xs = _mm512_loadu_ps(x + v);
            const __m512 d = _mm512_mul_ps(_mm512_sub_ps(top16, xs), _mm512_set1_ps((float)PER_NAT));
            const __mmask16 in_range = _mm512_cmp_ps_mask(d, _mm512_set1_ps((float)NEAR), _CMP_LT_OQ);
            const __m512i b = _mm512_mask_blend_epi32(in_range, _mm512_set1_epi32(FAR), _mm512_cvttps_epi32(d));
            _mm256_storeu_si256((__m256i *)(s->bucket + v), _mm512_cvtepi32_epi16(b));
            const __mmask16 finite = _mm512_cmp_ps_mask(xs, minus_inf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(finite, exp_nonpositive16(_mm512_sub_ps(xs, top16)));
            _mm512_storeu_ps(s->weight + v, e);
            mass = _mm512_add_ps(mass, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, floor16, _CMP_GE_OQ), e));
            const __mmask16 near = _mm512_cmp_epi32_mask(b, _mm512_set1_epi32(FIRST), _MM_CMPINT_LT);
            _mm512_mask_compressstoreu_epi32(s->near + n_near, near, _mm512_add_epi32(_mm512_set1_epi32((int)v), lanes));
            n_near += __builtin_popcount(near);
        }
        kept_mass = _mm512_reduce_add_ps(mass);
    }
#endif
    for (; v < n; v++) {
        const int b = bucket_of(top, x[v]);
        s->bucket[v] = (uint16_t)b;
        s->weight[v] = weight_of(top, x[v]);
        if (s->weight[v] >= min_p) kept_mass += s->weight[v];
        if (b < FIRST) s->near[n_near++] = (int32_t)v;
    }

    /* top-k: the k-th largest value (with repeats: s[k - 1] of the sorted row) */
    const int64_t k = top_k <= 0 ? n : (top_k < n ? top_k : n);
    float kth = -INFINITY;
    int kth_bucket = FAR;
    if (k < n) {
        int64_t count[BUCKETS] = {0};
        if (n_near >= k) { /* the k-th is in the near list */
            for (int64_t j = 0; j < n_near; j++) count[s->bucket[s->near[j]]]++;
        } else {
            for (v = 0; v < n; v++) count[s->bucket[v]]++;
        }
        int b = 0;
        int64_t above = 0;
        while (above + count[b] < k) above += count[b++];
        collect(x, n, s, n_near, b, -INFINITY, -INFINITY);
        kth = s->entries[k - above - 1].x;
        kth_bucket = b;
    }

    /* top-p over the survivors of min-p and top-k: the last kept entry, as its bucket and its
     * (value, index); entries in earlier buckets are kept, in later ones cut */
    int cut_bucket = BUCKETS;
    float cut_x = INFINITY;
    int64_t cut_at = -1;
    if (top_p < 1.0f) {
        double mass[BUCKETS] = {0.0};
        double total = kept_mass;
        if (k < n) { /* the mass of the top-k survivors alone */
            total = 0.0;
            const int listed = kth_bucket < FIRST;
            for (int64_t j = 0, count = listed ? n_near : n; j < count; j++) {
                const int64_t i = listed ? s->near[j] : j;
                if (x[i] >= kth && s->weight[i] >= min_p) total += s->weight[i];
            }
        }
        cut_bucket = -1; /* no survivor (total 0): the reference's softmax of all -inf keeps none */
        if (total > 0.0) {
            const double target = (double)top_p * total;
            double above = 0.0;
            for (int64_t j = 0; j < n_near; j++) {
                const int64_t i = s->near[j];
                if (x[i] >= kth && s->weight[i] >= min_p) mass[s->bucket[i]] += s->weight[i];
            }
            int b = 0;
            while (b < FIRST && above + mass[b] < target) above += mass[b++];
            if (b == FIRST) { /* past the near list: every bucket's mass */
                memset(mass, 0, sizeof mass);
                for (v = 0; v < n; v++)
                    if (x[v] >= kth && s->weight[v] >= min_p) mass[s->bucket[v]] += s->weight[v];
                above = 0.0;
                b = 0;
                while (b < FAR && above + mass[b] < target) above += mass[b++];
            }
            const int64_t m = collect(x, n, s, n_near, b, kth, min_p);
            cut_bucket = b;
            for (int64_t j = 0; j < m && above < target; j++) { /* entry j is kept while the mass above it < top_p */
                cut_x = s->entries[j].x;
                cut_at = s->entries[j].at;
                above += s->entries[j].e;
            }
        }
    }

    v = 0;
#if defined(__AVX512F__)
    {
        const __m512 kth16 = _mm512_set1_ps(kth), floor16 = _mm512_set1_ps(min_p), cut_x16 = _mm512_set1_ps(cut_x);
        const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
        const __m512i cut_b16 = _mm512_set1_epi32(cut_bucket), cut_at16 = _mm512_set1_epi32((int)cut_at);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; v + 16 <= n; v += 16) {
            const __m512 xs = _mm512_loadu_ps(x + v);
            __mmask16 keep = _mm512_cmp_ps_mask(xs, kth16, _CMP_GE_OQ)
                             & _mm512_cmp_ps_mask(_mm512_loadu_ps(s->weight + v), floor16, _CMP_GE_OQ);
            if (cut_bucket < BUCKETS) {
                const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s->bucket + v)));
                const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)v), lanes);
                const __mmask16 same = _mm512_cmp_epi32_mask(b, cut_b16, _MM_CMPINT_EQ);
                const __mmask16 after = _mm512_cmp_ps_mask(xs, cut_x16, _CMP_GT_OQ)
                                        | (_mm512_cmp_ps_mask(xs, cut_x16, _CMP_EQ_OQ)
                                           & _mm512_cmp_epi32_mask(at, cut_at16, _MM_CMPINT_LE));
                keep &= _mm512_cmp_epi32_mask(b, cut_b16, _MM_CMPINT_LT) | (same & after);
            }
            _mm512_storeu_ps(out + v, _mm512_mask_blend_ps(keep, minus_inf, xs));
        }
    }
#endif
    for (; v < n; v++) {
        int keep = x[v] >= kth && s->weight[v] >= min_p;
        if (keep && cut_bucket < BUCKETS) {
            const int b = s->bucket[v];
            keep = b < cut_bucket || (b == cut_bucket && (x[v] > cut_x || (x[v] == cut_x && v <= cut_at)));
        }
        out[v] = keep ? x[v] : -INFINITY;
    }
}

typedef struct {
    const float *x;
    int64_t x_stride, cols;
    const int32_t *top_k;
    const float *top_p, *min_p;
    float *out;
} filter_args_t;

static void *filter_part(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const filter_args_t *a = (const filter_args_t *)p->args;
    scratch_t *s = claim();
    for (int64_t r = p->lo; r < p->hi; r++)
        filter_row(a->x + r * a->x_stride, a->out + r * a->cols, a->cols, a->top_k[r], a->top_p[r], a->min_p[r], s);
    give_back(s);
    return NULL;
}

/* out (rows x cols, contiguous) = the reference's apply_top_k_top_p_min_p of x (rows x_stride
 * apart, cols < 2^31; a row holding NaN or +inf copied unfiltered). Needs
 * blink_sampling_reserve(cols, threads) first. */
void blink_filter_rows(const float *x, int64_t x_stride, const int32_t *top_k, const float *top_p, const float *min_p,
                       float *out, int64_t rows, int64_t cols, int threads) {
    const filter_args_t a = {x, x_stride, cols, top_k, top_p, min_p, out};
    blink_run_parts(filter_part, &a, rows, blink_threads_for(rows, 1, threads));
}
