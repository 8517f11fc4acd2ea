/* One pool of worker threads for the process's CPU kernels (cpu_attention.c, cpu_q4_linear.c,
 * cpu_fused.c), built at first use by kernels/cpu_pool.py, which hands blink_pool_split to each
 * kernel library (cpu_kernels.h's blink_use_pool). One pool for all of them: with one per
 * library, one library's workers polled on the cores another's needed (measured slower than no
 * split at all on two vCPUs).
 *
 * Workers start at the first call that splits and are kept (a thread started per call cost
 * ~50-100 us plus its first AMX use: two threads gave 1.25x on a prefill's projections
 * instead of 1.5x). Between calls a worker polls for BLINK_POLL_NS, then sleeps on a condition
 * variable: waking a sleeping thread costs ~50 us on a VM (its idle vCPU halted), as much as
 * splitting saves on a prefill's smaller calls, and a prefill's calls follow each other within
 * the poll; a decode step's calls do not split, so between prefills the workers sleep and the
 * cores stay free. One call at a time uses the pool; a concurrent one runs its parts on its own
 * thread.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "cpu_kernels.h"

enum { BLINK_POLL_NS = 200000 };

static inline void blink_pause(void) { /* a polling loop's hint to the core */
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}


typedef struct {
    pthread_mutex_t in_use; /* held by the call that uses the pool */
    pthread_mutex_t lock;   /* guards the fields below */
    pthread_cond_t wake, done;
    int workers;            /* started; worker i (1-based) runs part i */
    unsigned long generation; /* bumped per call */
    void *(*run)(void *);
    blink_part_t *parts;
    int count;              /* parts of this call run by the pool: 0 .. count - 1 */
    int remaining;          /* worker parts of this call not yet finished */
} blink_pool_t;

static blink_pool_t blink_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                                  PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0};

static inline int64_t blink_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Polls until *word != value or BLINK_POLL_NS pass; returns whether it changed. */
static inline int blink_poll_change(const unsigned long *word, unsigned long value) {
    const int64_t until = blink_now_ns() + BLINK_POLL_NS;
    for (int i = 0;; i++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value) return 1;
        if ((i & 63) == 63 && blink_now_ns() > until) return 0;
        blink_pause();
    }
}

static void *blink_pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned long seen = 0;
    char name[16]; /* its role in blink/threads/roles.py, so that the thread policy finds it */
    snprintf(name, sizeof name, "blink-kern-%d", index - 1);
    pthread_setname_np(pthread_self(), name);
    pthread_mutex_lock(&blink_pool.lock);
    for (;;) {
        if (blink_pool.generation == seen) {
            pthread_mutex_unlock(&blink_pool.lock);
            blink_poll_change(&blink_pool.generation, seen);
            pthread_mutex_lock(&blink_pool.lock);
        }
        while (blink_pool.generation == seen) pthread_cond_wait(&blink_pool.wake, &blink_pool.lock);
        seen = blink_pool.generation;
        if (index >= blink_pool.count) continue; /* not needed by this call */
        void *(*run)(void *) = blink_pool.run;
        blink_part_t *part = &blink_pool.parts[index];
        pthread_mutex_unlock(&blink_pool.lock);
        run(part);
        pthread_mutex_lock(&blink_pool.lock);
        __atomic_store_n(&blink_pool.remaining, blink_pool.remaining - 1, __ATOMIC_RELEASE);
        if (blink_pool.remaining == 0) pthread_cond_signal(&blink_pool.done);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own pool when it needs one. */
static void blink_pool_after_fork(void) {
    blink_pool = (blink_pool_t){PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                                PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0};
}

static void blink_pool_register_fork(void) { pthread_atfork(NULL, NULL, blink_pool_after_fork); }

/* run(part) over [0, items) split evenly into `threads` parts (at most BLINK_MAX_THREADS and
 * `items`): the first on the calling thread, the others on the workers (parts that no worker
 * can take run here after the first). Returns 0 or the last nonzero status. */
int blink_pool_split(void *(*run)(void *), const void *args, int64_t items, int threads) {
    if (threads > BLINK_MAX_THREADS) threads = BLINK_MAX_THREADS;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    blink_part_t part[BLINK_MAX_THREADS];
    for (int i = 0; i < threads; i++) part[i] = (blink_part_t){args, items * i / threads, items * (i + 1) / threads, 0};
    int pooled = 0; /* parts 1 .. pooled - 1 run on workers */
    if (threads > 1 && pthread_mutex_trylock(&blink_pool.in_use) == 0) {
        static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
        pthread_once(&fork_handler, blink_pool_register_fork);
        while (blink_pool.workers < threads - 1) {
            pthread_t tid;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            const int started = pthread_create(&tid, &attr, blink_pool_worker,
                                               (void *)(intptr_t)(blink_pool.workers + 1)) == 0;
            pthread_attr_destroy(&attr);
            if (!started) break; /* the parts past the workers run here */
            blink_pool.workers++;
        }
        pooled = threads < blink_pool.workers + 1 ? threads : blink_pool.workers + 1;
        pthread_mutex_lock(&blink_pool.lock);
        blink_pool.run = run;
        blink_pool.parts = part;
        blink_pool.count = pooled;
        blink_pool.remaining = pooled - 1;
        __atomic_store_n(&blink_pool.generation, blink_pool.generation + 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&blink_pool.wake);
        pthread_mutex_unlock(&blink_pool.lock);
    }
    run(&part[0]);
    for (int i = pooled > 1 ? pooled : 1; i < threads; i++) run(&part[i]);
    if (pooled > 1) {
        const int64_t until = blink_now_ns() + BLINK_POLL_NS; /* the workers' parts end about now */
        for (int i = 0; __atomic_load_n(&blink_pool.remaining, __ATOMIC_ACQUIRE) > 0; i++) {
            if ((i & 63) == 63 && blink_now_ns() > until) break;
            blink_pause();
        }
        pthread_mutex_lock(&blink_pool.lock);
        while (blink_pool.remaining > 0) pthread_cond_wait(&blink_pool.done, &blink_pool.lock);
        pthread_mutex_unlock(&blink_pool.lock);
    }
    if (pooled > 0) pthread_mutex_unlock(&blink_pool.in_use);
    int status = 0;
    for (int i = 0; i < threads; i++)
        if (part[i].status != 0) status = part[i].status;
    return status;
}
