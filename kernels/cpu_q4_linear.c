/* y = x @ W.T (+ bias) for bf16 x and a weight kept as a GGUF file's own 4-bit codes (Q4_0,
 * Q4_1), on CPUs with AMX (Intel Sapphire Rapids and later).
 *
 * Why: a decode step of SmolLM2-135M streams every projection weight once; in bf16 that is
 * ~210 MB, which costs one core here ~23 ms whether the step has 1 or 16 rows. The codes are
 * 4x fewer bytes. torch's int4 CPU kernel reads them too, but its arithmetic grows with the
 * rows (slower than bf16 beyond ~8 rows). Here AMX does the arithmetic: a group of 32
 * channels of 16 columns is one tile product for up to 16 rows, and what is left per weight
 * is widening its nibble to a bf16 code, the same for 1 row or 16 (kernels/cpu_q4_linear.py
 * picks the rows it takes; docs/benchmarks.md, "4-bit weights at decode-batch sizes").
 *
 * Arithmetic: Q4's weight is w = d q + m per group of 32 channels (the file's fp16 d and m;
 * Q4_0: m = -8d), so x . w = d (x . q) + m sum(x). AMX computes x . q on the codes as bf16
 * (0..15, exact) with fp32 sums; the per-group d and m are applied in fp32. No weight is
 * rounded to bf16: the result is gguf's fp32 weight's product, up to fp32 sum order.
 *
 * Layout (made by kernels/cpu_q4_linear.py, `pack`): output columns in tiles of 16, channels
 * in groups of 32. A (tile, group) is the B tile AMX multiplies, 16 rows of 32 words, row p
 * holding channels 2p and 2p + 1 of the 16 columns interleaved (word w: column w / 2, channel
 * 2p + w % 2), packed as 4 x 32 16-bit words whose nibble i is row 4c + i's code. Per tile
 * and group, 16 fp16 d then 16 fp16 m, one per column.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { TILE = 16, GROUP = 32, PAIRS = GROUP / 2, WORDS = 4 * 32, MAX_ROWS = 16, STEP = 4, MAX_THREADS = 64 };

/* How far ahead the codes are prefetched: ~8% faster at 1-16 rows than none (1-2 KB measured
 * best, 8 KB and more no better than none). */
enum { PREFETCH_BYTES = 2048 };

/* Linux: a process must ask before it uses AMX's tile data (arch/x86/include/uapi/asm/prctl.h) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    const uint16_t *x;       /* [M, K] bf16, rows x_stride apart */
    int64_t x_stride;
    const uint16_t *codes;   /* [N / 16, K / 32, 4, 32] */
    const uint16_t *scales;  /* [N / 16, K / 32, 2, 16] fp16: d, m */
    const uint16_t *bias;    /* [N] bf16 or NULL */
    uint16_t *y;             /* [M, N] bf16, rows y_stride apart */
    int64_t y_stride;
    int64_t M, N, K;
    const float *x_sums;     /* [M, K / 32]: each row's sum over each group */
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

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* Tiles 0-3: four groups' x . q (rows x 16 columns, fp32); 4, 6: x (rows x 32 channels) and
 * 5, 7: codes (16 channel pairs x 16 columns), in turn. */
static void configure(int rows) {
    tile_config_t config;
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

static inline void store_tile(const args_t *a, const __m512 *acc, int64_t t, int64_t r0, int rows) {
    __m512 bias = _mm512_setzero_ps();
    if (a->bias) /* bf16 -> fp32: the top half of each word */
        bias = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a->bias + t * TILE))), 16));
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(a->y + (r0 + r) * a->y_stride + t * TILE),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r], bias)));
}

/* Tile registers are named by constants, so the four groups of a step are spelled out. All
 * four are unpacked before the first product, so the unpacking overlaps the tile unit. */
#define UNPACK(J) if (J < count) unpack_group(codes + (g + J) * WORDS, unpacked[J], as_bf16);
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

/* Tile t (16 columns) for rows [r0, r0 + rows), rows <= 16. */
static void tile_pass(const args_t *a, int64_t t, int64_t r0, int rows, __m512i as_bf16) {
    const int64_t groups = a->K / GROUP, x_bytes = a->x_stride * 2;
    const uint16_t *codes = a->codes + t * groups * WORDS, *scales = a->scales + t * groups * 2 * TILE;
    const uint16_t *x = a->x + r0 * a->x_stride;
    const float *x_sums = a->x_sums + r0 * groups;
    uint16_t unpacked[STEP][PAIRS * 2 * TILE] __attribute__((aligned(64)));
    float dots[STEP][MAX_ROWS * TILE] __attribute__((aligned(64)));
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += STEP) {
        const int count = (int)(groups - g < STEP ? groups - g : STEP);
        UNPACK(0) UNPACK(1) UNPACK(2) UNPACK(3)
        MULTIPLY(0, 4, 5) MULTIPLY(1, 6, 7) MULTIPLY(2, 4, 5) MULTIPLY(3, 6, 7)
        SCALE(0) SCALE(1) SCALE(2) SCALE(3)
    }
    store_tile(a, acc, t, r0, rows);
}

typedef struct { const args_t *a; int64_t lo, hi; } part_t;

static void *run_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    const args_t *a = p->a;
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

/* 1 where this process may use AMX (asked of the kernel once; Linux 5.16 and later). */
int blink_q4_linear_supported(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Returns 0; -2 for shapes this kernel does not take (the caller checks them first); -3
 * where AMX is not granted; -4 out of memory. `threads` split the column tiles when the
 * product is large enough to pay for them. */
int blink_q4_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    if (M < 1 || N % TILE || K % GROUP || x_stride < K || y_stride < N) return -2;
    if (!blink_q4_linear_supported()) return -3;
    float *x_sums = malloc((size_t)(M * (K / GROUP)) * sizeof *x_sums);
    if (!x_sums) return -4;
    group_sums(x, x_stride, M, K, x_sums);
    args_t a = {x, x_stride, codes, scales, bias, y, y_stride, M, N, K, x_sums};
    const int64_t tiles = N / TILE;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* a thread start costs ~20-50 us: one per ~2M weights (~0.1 ms of work) at most */
    while (threads > 1 && N * K < ((int64_t)threads << 21)) threads--;
    if (threads > tiles) threads = (int)tiles;
    pthread_t tid[MAX_THREADS];
    part_t part[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    for (int i = 0; i < threads; i++) part[i] = (part_t){&a, tiles * i / threads, tiles * (i + 1) / threads};
    for (int i = 1; i < threads; i++) running[i] = pthread_create(&tid[i], NULL, run_part, &part[i]) == 0;
    run_part(&part[0]);
    for (int i = 1; i < threads; i++) {
        if (running[i]) pthread_join(tid[i], NULL);
        else run_part(&part[i]);
    }
    free(x_sums);
    return 0;
}

#else /* no AMX in this build: the Python side keeps its other paths */

int blink_q4_linear_supported(void) { return 0; }

int blink_q4_linear(const uint16_t *x, int64_t x_stride, const uint16_t *codes, const uint16_t *scales,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                    int threads) {
    (void)x; (void)x_stride; (void)codes; (void)scales; (void)bias; (void)y; (void)y_stride;
    (void)M; (void)N; (void)K; (void)threads;
    return -2;
}

#endif
