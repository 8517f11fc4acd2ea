/* One pool of worker threads for the process's CPU kernels (attention.c, q4_linear.c,
 * fused.c), built at first use by kernels/cpu/pool.py, which hands blink_pool_split to each
 * kernel library (kernels.h's blink_use_pool). One pool for all of them: with one per
 * library, one library's workers polled on the cores another's needed (measured slower than no
 * split at all on two vCPUs).
 *
 * Workers start at the first call that splits and are kept (a thread started per call cost
 * ~50-100 us plus its first AMX use: two threads gave 1.25x on a prefill's projections
 * instead of 1.5x). Between calls a worker polls for BLINK_POLL_NS, then sleeps on a condition
 * variable: waking a sleeping thread costs ~50 us on a VM (its idle vCPU halted), and a
 * step's calls follow each other within the poll, so the workers sleep between steps and
 * while the engine is idle. One call at a time uses the pool; a concurrent one runs on its
 * own thread.
 *
 * A call takes no lock while its threads poll: the caller publishes the call's fields and
 * then its generation, a polling worker reads them after it, and the lock and condition
 * variables are touched only by a thread that sleeps and by whoever must wake it (`sleepers`,
 * `caller_sleeps`: each side writes its flag, then reads the other's, both sequentially
 * consistent, so one of the two sees the other). The lock on every call cost a decode step's
 * ~120 split calls ~0.8 us each between the slower part's end and the call's return.
 *
 * A call's parts are claimed, not assigned: the caller and the workers each take the next
 * unclaimed part until none is left, and the caller waits only for parts a worker has
 * started. On a host whose other cores also run the frontend and the client, a worker that
 * is not running when a call starts (preempted, or still waking) leaves its part to the
 * caller instead of holding up the call. With one part assigned per thread, splitting a
 * decode step's calls served slower than not splitting them (session 27); claimed, it serves
 * 1.16-1.22x faster (docs/performance.md#kernel-threads).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "kernels.h"

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
    pthread_mutex_t lock;   /* guards the sleeps (wake, done) */
    pthread_cond_t wake, done;
    int workers;            /* started; worker i (1-based) takes part in calls of more than i threads */
    int sleepers;           /* workers asleep on `wake`, or about to be */
    int caller_sleeps;      /* the caller asleep on `done`, or about to be */
    /* the call: written (release) before `generation`, read (acquire) after it. A late worker
     * may read some of the next call's fields: each call closes its claim word before the next
     * call's fields are written, so a worker that read any of them sees the closed word (or the
     * next call's), and its claim, which carries the generation it saw, fails */
    _Alignas(64) unsigned long generation; /* bumped per call (the call's fields share its line) */
    int threads;            /* this call's */
    int64_t parts;          /* and its parts (at least one per thread) */
    void *(*run)(void *);
    const void *args;
    int64_t items;
    uint64_t claim;         /* (generation's low 32 bits) << 32 | the next unclaimed part */
    int64_t finished;       /* parts of this call finished */
    int status;             /* a nonzero part status of this call, or 0 */
} blink_pool_t;

static blink_pool_t blink_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                                  PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

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

/* Claims and runs parts of the call tagged `tag` until none is left (or that call is over:
 * a claim carries the tag, so a late thread never takes a part of the next call). */
static void blink_claim_parts(uint64_t tag, void *(*run)(void *), const void *args, int64_t items, int64_t parts) {
    uint64_t claim = __atomic_load_n(&blink_pool.claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((claim >> 32) != tag || (int64_t)(claim & 0xffffffffu) >= parts) return;
        if (!__atomic_compare_exchange_n(&blink_pool.claim, &claim, claim + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* `claim` now holds the current value */
        const int64_t c = (int64_t)(claim & 0xffffffffu);
        blink_part_t part = {args, items * c / parts, items * (c + 1) / parts, 0};
        run(&part);
        if (part.status != 0) __atomic_store_n(&blink_pool.status, part.status, __ATOMIC_RELAXED);
        if (__atomic_add_fetch(&blink_pool.finished, 1, __ATOMIC_SEQ_CST) == parts) {
            if (__atomic_load_n(&blink_pool.caller_sleeps, __ATOMIC_SEQ_CST)) {
                pthread_mutex_lock(&blink_pool.lock);
                pthread_cond_signal(&blink_pool.done);
                pthread_mutex_unlock(&blink_pool.lock);
            }
            return;
        }
        claim = __atomic_load_n(&blink_pool.claim, __ATOMIC_ACQUIRE);
    }
}

static void *blink_pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned long seen = 0;
    char name[16]; /* its role in blink/threads/roles.py, so that the thread policy finds it */
    snprintf(name, sizeof name, "blink-kern-%d", index - 1);
    pthread_setname_np(pthread_self(), name);
    for (;;) {
        if (!blink_poll_change(&blink_pool.generation, seen)) {
            pthread_mutex_lock(&blink_pool.lock);
            __atomic_add_fetch(&blink_pool.sleepers, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&blink_pool.generation, __ATOMIC_SEQ_CST) == seen)
                pthread_cond_wait(&blink_pool.wake, &blink_pool.lock);
            __atomic_sub_fetch(&blink_pool.sleepers, 1, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&blink_pool.lock);
        }
        seen = __atomic_load_n(&blink_pool.generation, __ATOMIC_ACQUIRE);
        const int threads = __atomic_load_n(&blink_pool.threads, __ATOMIC_ACQUIRE);
        if (index >= threads) continue; /* not needed by this call */
        const int64_t parts = __atomic_load_n(&blink_pool.parts, __ATOMIC_ACQUIRE);
        /* the call's fields, as of `seen` or a later call's (then no claim succeeds) */
        void *(*run)(void *) = __atomic_load_n(&blink_pool.run, __ATOMIC_ACQUIRE);
        const void *args = __atomic_load_n(&blink_pool.args, __ATOMIC_ACQUIRE);
        const int64_t items = __atomic_load_n(&blink_pool.items, __ATOMIC_ACQUIRE);
        blink_claim_parts(seen & 0xffffffffu, run, args, items, parts);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own pool when it needs one. */
static void blink_pool_after_fork(void) {
    blink_pool = (blink_pool_t){PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                                PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};
}

static void blink_pool_register_fork(void) { pthread_atfork(NULL, NULL, blink_pool_after_fork); }

/* run(part) over [0, items) on up to `threads` threads (at most BLINK_MAX_THREADS): the calling
 * thread and the pool's workers claim the `parts` parts of the items (at least one a thread, at
 * most one an item) until none is left; the call returns when every part is finished. Without
 * the pool (another call holds it, or no worker could be started) all items run here as one
 * part. Returns 0 or a nonzero part status. */
int blink_pool_split(void *(*run)(void *), const void *args, int64_t items, int threads, int64_t parts) {
    if (threads > BLINK_MAX_THREADS) threads = BLINK_MAX_THREADS;
    if (threads > items) threads = (int)items;
    if (parts < threads) parts = threads;
    if (parts > items) parts = items;
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
            if (!started) break; /* fewer threads take part */
            blink_pool.workers++;
        }
        if (blink_pool.workers > 0) {
            const unsigned long generation = __atomic_load_n(&blink_pool.generation, __ATOMIC_RELAXED) + 1;
            /* (the previous call closed its claim word before these stores: see blink_pool_t) */
            __atomic_store_n(&blink_pool.threads, threads, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.parts, parts, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.run, run, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.args, args, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.items, items, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.finished, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&blink_pool.status, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&blink_pool.claim, (uint64_t)(generation & 0xffffffffu) << 32, __ATOMIC_RELEASE);
            __atomic_store_n(&blink_pool.generation, generation, __ATOMIC_SEQ_CST); /* publishes the above */
            if (__atomic_load_n(&blink_pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
                pthread_mutex_lock(&blink_pool.lock);
                pthread_cond_broadcast(&blink_pool.wake);
                pthread_mutex_unlock(&blink_pool.lock);
            }
            blink_claim_parts(generation & 0xffffffffu, run, args, items, parts);
            /* wait for the parts that workers started: they end about now */
            const int64_t until = blink_now_ns() + BLINK_POLL_NS;
            for (int i = 0; __atomic_load_n(&blink_pool.finished, __ATOMIC_ACQUIRE) < parts; i++) {
                if ((i & 63) == 63 && blink_now_ns() > until) break;
                blink_pause();
            }
            if (__atomic_load_n(&blink_pool.finished, __ATOMIC_ACQUIRE) < parts) {
                pthread_mutex_lock(&blink_pool.lock);
                __atomic_store_n(&blink_pool.caller_sleeps, 1, __ATOMIC_SEQ_CST);
                while (__atomic_load_n(&blink_pool.finished, __ATOMIC_SEQ_CST) < parts)
                    pthread_cond_wait(&blink_pool.done, &blink_pool.lock);
                __atomic_store_n(&blink_pool.caller_sleeps, 0, __ATOMIC_RELAXED);
                pthread_mutex_unlock(&blink_pool.lock);
            }
            const int status = __atomic_load_n(&blink_pool.status, __ATOMIC_ACQUIRE);
            /* close the claim word: no part is left, whatever `parts` a late worker reads */
            __atomic_store_n(&blink_pool.claim, (uint64_t)(generation & 0xffffffffu) << 32 | 0xffffffffu, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&blink_pool.in_use);
            return status;
        }
        pthread_mutex_unlock(&blink_pool.in_use);
    }
    blink_part_t part = {args, 0, items, 0};
    run(&part);
    return part.status;
}
