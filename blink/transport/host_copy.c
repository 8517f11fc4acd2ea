/* Blink's loopback "NIC": many (source address, destination offset, length) copies in one call.
 *
 * A KV transfer of a fragmented block pool is thousands of small block copies (a 6 KiB block
 * per layer, K and V); done from Python each costs more in interpreter overhead than in bytes,
 * and a numpy gather-then-scatter moves every byte twice. Here each byte moves once, as an
 * RDMA WRITE list would move it, split by bytes over `threads` threads (the engine's torch
 * intra-op thread count, so a transfer uses what a torch copy_ of the same bytes would).
 * Built at first use by blink/transport/host_copy.py; the Python fallback there is the
 * reference the tests compare it with.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct { int64_t src, dst_offset, length; } segment_t;
typedef struct { char *dst; const segment_t *seg; int64_t n, lo, hi; } part_t;

/* Copy bytes [lo, hi) of the segments laid end to end. */
static void *copy_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    int64_t pos = 0;
    for (int64_t i = 0; i < p->n && pos < p->hi; i++) {
        int64_t len = p->seg[i].length, start = pos;
        pos += len;
        if (pos <= p->lo) continue;
        int64_t from = start < p->lo ? p->lo - start : 0;
        int64_t to = pos > p->hi ? p->hi - start : len;
        if (i + 1 < p->n) {
            /* The next piece starts at an unrelated address, where the hardware prefetcher
             * has nothing to go on: ask for its first lines now (measured ~8% faster for
             * 6 KiB pieces, docs/performance.md#kv-transfer). */
            const char *next_src = (const char *)(intptr_t)p->seg[i + 1].src;
            const char *next_dst = p->dst + p->seg[i + 1].dst_offset;
            for (int line = 0; line < 512; line += 64) {
                __builtin_prefetch(next_src + line, 0, 3);
                __builtin_prefetch(next_dst + line, 1, 3);
            }
        }
        memcpy(p->dst + p->seg[i].dst_offset + from,
               (const char *)(intptr_t)p->seg[i].src + from, (size_t)(to - from));
    }
    return NULL;
}

/* Returns the bytes copied. Threads only above 256 KiB each: below, starting one (~20-50 us)
 * costs more than it saves. */
int64_t blink_copy_segments(char *dst, const segment_t *seg, int64_t n, int threads) {
    enum { MAX_THREADS = 64 };
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += seg[i].length;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    while (threads > 1 && total < ((int64_t)threads << 18)) threads--;
    pthread_t tid[MAX_THREADS];
    part_t part[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++)
        part[t] = (part_t){dst, seg, n, total * t / threads, total * (t + 1) / threads};
    for (int t = 1; t < threads; t++)
        running[t] = pthread_create(&tid[t], NULL, copy_part, &part[t]) == 0;
    copy_part(&part[0]);
    for (int t = 1; t < threads; t++) {
        if (running[t]) pthread_join(tid[t], NULL);
        else copy_part(&part[t]); /* no thread to be had: do its share here */
    }
    return total;
}
