/* GENERATED from kernels/cpu/abi.py's tables by `python -m blink.kernels.cpu.abi > kernels/cpu/replay.c`:
 * do not edit (tests/test_cpu_abi.py fails when this file is not what abi.replay_source() writes).
 *
 * A CPU graph's replay (kernels/cpu/graph.py) in C: the recorded kernel calls, made in order
 * with the arguments recorded, in one call from Python instead of one ctypes call each (a
 * decode step of SmolLM2-135M makes ~270). A call is a function pointer, the index of the
 * thunk that calls it through its exact prototype (one per distinct signature in the tables),
 * whether it returns a status (0: done), and where its arguments start in one array.
 */
#include <stdint.h>

typedef union {
    void *p;
    int64_t i; /* int64_t and int arguments (an int is passed as (int)i) */
    float f;
} blink_arg_t;

typedef struct {
    const void *fn;
    int64_t thunk;   /* index in THUNKS */
    int64_t checked; /* returns a status: nonzero stops the replay */
    int64_t first;   /* its first argument's index in the arguments array */
} blink_call_t;

static int64_t thunk_0(const void *fn, const blink_arg_t *a) {
    (void)a;
    return (int64_t)((int (*)(void))fn)();
}

static int64_t thunk_1(const void *fn, const blink_arg_t *a) {
    ((void (*)(void *))fn)(a[0].p);
    return 0;
}

static int64_t thunk_2(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, void *, int64_t, int, int64_t))fn)(a[0].p, a[1].p, a[2].i, (int)a[3].i, a[4].i);
}

static int64_t thunk_3(const void *fn, const blink_arg_t *a) {
    ((void (*)(int))fn)((int)a[0].i);
    return 0;
}

static int64_t thunk_4(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, int64_t, int64_t, void *, void *, void *, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, void *, void *, void *, void *, void *, int64_t, int64_t, float, int))fn)(a[0].p, a[1].i, a[2].i, a[3].p, a[4].p, a[5].p, (int)a[6].i, (int)a[7].i, a[8].i, a[9].i, a[10].i, a[11].i, a[12].i, a[13].i, a[14].i, a[15].p, a[16].p, a[17].p, a[18].p, a[19].p, a[20].i, a[21].i, a[22].f, (int)a[23].i);
}

static int64_t thunk_5(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, int64_t, void *, int64_t, void *, void *, void *, int64_t, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].i, a[4].p, a[5].p, a[6].p, a[7].i, a[8].i, a[9].i, (int)a[10].i);
}

static int64_t thunk_6(const void *fn, const blink_arg_t *a) {
    ((void (*)(void *, int64_t, void *, int64_t, void *, void *, void *, int64_t, int64_t, float, int))fn)(a[0].p, a[1].i, a[2].p, a[3].i, a[4].p, a[5].p, a[6].p, a[7].i, a[8].i, a[9].f, (int)a[10].i);
    return 0;
}

static int64_t thunk_7(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, int64_t, void *, int64_t, void *, void *, int64_t, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].i, a[4].p, a[5].p, a[6].i, a[7].p, a[8].i, a[9].i, a[10].i, a[11].i, a[12].i, (int)a[13].i);
}

static int64_t thunk_8(const void *fn, const blink_arg_t *a) {
    ((void (*)(void *, int64_t, void *, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].i, a[4].i, (int)a[5].i);
    return 0;
}

static int64_t thunk_9(const void *fn, const blink_arg_t *a) {
    ((void (*)(void *, int64_t, void *, void *, void *, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].p, a[4].p, a[5].i, a[6].i, (int)a[7].i);
    return 0;
}

static int64_t thunk_10(const void *fn, const blink_arg_t *a) {
    ((void (*)(void *, int64_t, void *, int64_t, int64_t, void *, void *, void *, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].i, a[4].i, a[5].p, a[6].p, a[7].p, a[8].i, a[9].i, (int)a[10].i);
    return 0;
}

static int64_t thunk_11(const void *fn, const blink_arg_t *a) {
    (void)a;
    return (int64_t)((int64_t (*)(void))fn)();
}

static int64_t thunk_12(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *))fn)(a[0].p);
}

static int64_t thunk_13(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, int64_t, void *, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int))fn)(a[0].p, a[1].i, a[2].p, a[3].p, a[4].p, a[5].p, a[6].i, a[7].i, a[8].i, a[9].i, (int)a[10].i);
}

static int64_t thunk_14(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int (*)(void *, int64_t, void *, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int, int))fn)(a[0].p, a[1].i, a[2].p, a[3].p, a[4].p, a[5].p, a[6].i, a[7].i, a[8].i, a[9].i, (int)a[10].i, (int)a[11].i);
}

static int64_t thunk_15(const void *fn, const blink_arg_t *a) {
    return (int64_t)((int64_t (*)(void *, int64_t, void *, void *))fn)(a[0].p, a[1].i, a[2].p, a[3].p);
}

static int64_t (*const THUNKS[])(const void *, const blink_arg_t *) = {
    thunk_0,
    thunk_1,
    thunk_2,
    thunk_3,
    thunk_4,
    thunk_5,
    thunk_6,
    thunk_7,
    thunk_8,
    thunk_9,
    thunk_10,
    thunk_11,
    thunk_12,
    thunk_13,
    thunk_14,
    thunk_15,
};

/* Make calls[0..n) in order. Returns -1 when every call is done, else the index of the
 * first call that returned a nonzero status (written to *status), after which none runs. */
int64_t blink_replay(const void *calls, int64_t n, const void *args, void *status) {
    const blink_call_t *c = (const blink_call_t *)calls;
    const blink_arg_t *a = (const blink_arg_t *)args;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = THUNKS[c[i].thunk](c[i].fn, a + c[i].first);
        if (c[i].checked && s != 0) {
            *(int64_t *)status = s;
            return i;
        }
    }
    return -1;
}
