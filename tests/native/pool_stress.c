/* tests/test_cpu_pool.py's stress of kernels/cpu/pool.c, built with it into one program: many
 * calls back to back and with pauses around the workers' poll, of varying items, threads and
 * parts; every item of every call must run exactly once, inside its call, and every call must
 * return its parts' status. Prints "ok CALLS" or the first failure, exits nonzero on one. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* kernels.h's blink_part_t (kernels.h itself defines functions pool.c defines too) */
typedef struct {
    const void *args;
    int64_t lo, hi;
    int status;
} blink_part_t;

int blink_pool_split(void *(*run)(void *), const void *args, int64_t items, int threads, int64_t parts);

enum { MAX_ITEMS = 4096 };

typedef struct {
    int *seen;      /* per item: times run in this call */
    int64_t items;
    int64_t fail_at; /* an item whose part returns status 5, or -1 */
    volatile int open; /* the call is running (a part run after its return is a failure) */
    int *late;
} call_t;

static void *run(void *arg) {
    blink_part_t *p = (blink_part_t *)arg;
    const call_t *c = (const call_t *)p->args;
    if (!c->open || p->lo < 0 || p->hi > c->items || p->lo >= p->hi) __atomic_add_fetch(c->late, 1, __ATOMIC_RELAXED);
    for (int64_t i = p->lo; i < p->hi && i < c->items; i++) {
        if (i >= 0) __atomic_add_fetch(&c->seen[i], 1, __ATOMIC_RELAXED);
        if (i == c->fail_at) p->status = 5;
    }
    return NULL;
}

static void pause_ns(long ns) {
    struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

int main(int argc, char **argv) {
    const long calls = argc > 1 ? atol(argv[1]) : 20000;
    static int seen[MAX_ITEMS];
    int late = 0;
    unsigned seed = 12345;
    for (long k = 0; k < calls; k++) {
        seed = seed * 1103515245u + 12345u;
        const int64_t items = 1 + (seed >> 8) % 300;
        const int threads = 2 + (int)((seed >> 4) % 3);
        const int64_t parts = threads + (int64_t)((seed >> 12) % 20);
        const int64_t fail_at = (seed >> 20) % 7 == 0 ? (int64_t)((seed >> 3) % items) : -1;
        call_t c = {seen, items, fail_at, 1, &late};
        for (int64_t i = 0; i < items; i++) seen[i] = 0;
        const int status = blink_pool_split(run, &c, items, threads, parts);
        c.open = 0;
        for (int64_t i = 0; i < items; i++)
            if (seen[i] != 1) {
                printf("call %ld: item %ld of %ld ran %d times (threads %d, parts %ld)\n", k, (long)i, (long)items,
                       seen[i], threads, (long)parts);
                return 1;
            }
        if (status != (fail_at >= 0 ? 5 : 0)) {
            printf("call %ld: status %d, wanted %d\n", k, status, fail_at >= 0 ? 5 : 0);
            return 1;
        }
        if (k % 97 == 0) pause_ns(250000); /* past the poll: the workers sleep */
        else if (k % 13 == 0) pause_ns(20000);
    }
    pause_ns(1000000);
    if (late) {
        printf("%d parts ran outside their call\n", late);
        return 1;
    }
    printf("ok %ld\n", calls);
    return 0;
}
