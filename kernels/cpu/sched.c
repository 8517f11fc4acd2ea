/* The scheduler's per-step stages in C, for the CPU loop (kernels/cpu/sched.py).
 *
 * The torch code of blink/engine/sched/ is the reference: each function here computes what
 * its stage there computes, bit for bit (tests/test_scheduler_c.py runs both side by side,
 * step by step). The CPU loop's host step makes ~300 small torch calls a token, a few
 * microseconds each; a stage here is one call that loops over the row window. The stages
 * mirror the fused Triton kernels (kernels/triton/sched.py), which do the same on a GPU.
 *
 * Ring writes keep the protocol's order (blink/engine/sched/publish.py): a stream's payload,
 * a fence, then its produced counter; a finish reason, a fence, then the FINISHED state
 * word, which is written with an atomic store (the frontend writes the state words of free
 * slots concurrently).
 */
#include <stdint.h>

/* The scheduler's constants (blink/engine/sched/state.py, blink/ring.py), set once by
 * blink_sched_constants in the order of sched.py's CONSTANTS. */
enum {
    C_ROW_EMPTY, C_ROW_WAITING, C_ROW_RUNNING, C_ROW_RELEASING,
    C_SLOT_WRITTEN, C_SLOT_FINISHED,
    C_FINISH_STOP, C_FINISH_LENGTH, C_FINISH_ERROR,
    C_K_PREFIX_QUERIES, C_K_PREFIX_HITS, C_K_PREEMPTIONS, C_K_STEPS, C_K_PROMPT_TOKENS,
    C_K_GENERATED_TOKENS,
    C_COUNT
};
static int64_t K[C_COUNT];

int blink_sched_constants(const int64_t *values, int64_t n) {
    if (n != C_COUNT)
        return 1;
    for (int64_t i = 0; i < n; i++)
        K[i] = values[i];
    return 0;
}

/* ------------------------------------------------------------------------- batch build */

/* Scheduler._build_batch (batch.py): the step's flat token batch and the sampler's rows, over
 * rows [0, S). Lanes [0, lanes) of the flat arrays are written: all T, or with host_lanes the
 * smallest bucket holding the step (as the torch code's host-guarded batch). Returns the
 * lanes written, or -1 when the step's tokens exceed the largest bucket. */
int64_t blink_sched_build_batch(
    int64_t S, int64_t T, int64_t N, int64_t B, int64_t M, int64_t host_lanes,
    const int64_t *num_new, const int64_t *num_computed, const int64_t *num_tokens,
    const int32_t *tokens, int64_t tokens_stride, const int32_t *block_table,
    const int64_t *buckets, int64_t n_buckets,
    int64_t *input_ids, int64_t *positions, int64_t *seq_idx, int64_t *slot_mapping,
    int32_t *query_start_loc, int32_t *seq_lens, int64_t *total_out, int64_t *bucket_out,
    int64_t *sample_rows, int64_t *num_sample_rows, int64_t *logits_indices) {
    int64_t total = 0, sampled = 0;
    query_start_loc[0] = 0;
    for (int64_t r = 0; r < S; r++) {
        int64_t n = num_new[r];
        total += n;
        query_start_loc[r + 1] = (int32_t)total;
        seq_lens[r] = n > 0 ? (int32_t)(num_computed[r] + n) : 0;
        sample_rows[r] = -1;
        logits_indices[r] = 0;
    }
    for (int64_t r = 0; r < S; r++)
        if (num_new[r] > 0 && num_computed[r] + num_new[r] == num_tokens[r]) {
            sample_rows[sampled] = r;
            logits_indices[sampled] = (int64_t)query_start_loc[r + 1] - 1;
            sampled++;
        }
    int64_t bucket = 0;
    while (bucket < n_buckets && buckets[bucket] < total)
        bucket++;
    int64_t lanes = T;
    if (host_lanes) {
        if (bucket == n_buckets)
            return -1;
        lanes = buckets[bucket];
    }
    *total_out = total;
    *bucket_out = bucket;
    *num_sample_rows = sampled;
    int64_t t = 0;
    for (int64_t r = 0; r < S && t < total; r++) {
        int64_t start = query_start_loc[r], end = query_start_loc[r + 1];
        for (; t < end; t++) {
            int64_t pos = num_computed[r] + t - start;
            int64_t block = block_table[r * M + pos / B];
            input_ids[t] = tokens[r * tokens_stride + pos];
            positions[t] = pos;
            seq_idx[t] = r;
            slot_mapping[t] = block * B + pos % B;
        }
    }
    for (; t < lanes; t++) {
        input_ids[t] = 0;
        positions[t] = 0;
        seq_idx[t] = 0;
        slot_mapping[t] = N * B;
    }
    return lanes;
}

/* ------------------------------------------------------------------------------- stats */

/* Scheduler._write_stats (stats.py): the ring's gauges and counters. ``stat_words``: the
 * control words of running, waiting, KV blocks used, KV blocks in all, then the counters
 * in the order of ``counter_index``. */
void blink_sched_write_stats(
    int64_t S, int64_t N, const int32_t *status, const int32_t *ring_state, int64_t state_stride,
    const int32_t *block_ref, const int64_t *counters, int64_t *control, const int64_t *stat_words) {
    int64_t running = 0, waiting = 0, used = 0;
    for (int64_t r = 0; r < S; r++) {
        int32_t s = status[r];
        running += s == K[C_ROW_RUNNING];
        waiting += s == K[C_ROW_WAITING];
        waiting += ring_state[r * state_stride] == K[C_SLOT_WRITTEN]
                   && (s == K[C_ROW_EMPTY] || s == K[C_ROW_RELEASING]);
    }
    for (int64_t b = 0; b < N; b++)
        used += block_ref[b] > 0;
    const int64_t counter_index[6] = {
        K[C_K_PREFIX_QUERIES], K[C_K_PREFIX_HITS], K[C_K_PREEMPTIONS], K[C_K_STEPS],
        K[C_K_PROMPT_TOKENS], K[C_K_GENERATED_TOKENS]};
    control[stat_words[0]] = running;
    control[stat_words[1]] = waiting;
    control[stat_words[2]] = used;
    control[stat_words[3]] = N;
    for (int i = 0; i < 6; i++)
        control[stat_words[4 + i]] = counters[counter_index[i]];
}

/* ----------------------------------------------------------------------------- publish */

/* The ring's per-slot stream fields as sched.py passes them: pointers and strides in
 * elements (slot, stream position). */
typedef struct {
    int64_t *produced;
    int64_t produced_stride;
    int32_t *tokens;
    int64_t tokens_s0, tokens_s1;
    float *logprob;
    int64_t logprob_s0, logprob_s1;
    int32_t *top_ids;
    int64_t top_ids_s0, top_ids_s1;
    float *top_logprobs;
    int64_t top_logprobs_s0, top_logprobs_s1;
    int32_t *finish_reason;
    int64_t finish_stride;
    int32_t *state_words; /* the slot state words: row r's is state_words[r] */
    int64_t capacity, num_top;
} blink_ring_streams_t;

/* The sampler's outputs for lanes [0, R): tokens (int32 or int64), logprobs, and ``width``
 * alternatives a lane (0: none asked for). */
typedef struct {
    const void *tokens;
    int64_t tokens_are_64;
    const float *logprob;
    const void *top_ids;
    int64_t top_ids_are_64;
    const float *top_logprobs;
    int64_t top_stride, width;
} blink_sampled_t;

/* The rows' state the publish stage reads and writes (rows [0, S) of the window). */
typedef struct {
    int64_t *num_tokens;
    const int64_t *num_prompt;
    int32_t *tokens;
    int64_t tokens_stride;
    int32_t *status;
    uint8_t *needs_lookup; /* torch.bool */
    int64_t *counters;
    const int32_t *stop_ids;
    int64_t stop_stride, n_stop;
    const int32_t *ignore_eos, *min_tokens, *max_tokens;
    const int64_t *eos;
    int64_t n_eos, max_model_len;
} blink_rows_t;

static int64_t sampled_token(const blink_sampled_t *out, int64_t i) {
    return out->tokens_are_64 ? ((const int64_t *)out->tokens)[i] : ((const int32_t *)out->tokens)[i];
}

/* Scheduler._publish_tokens (publish.py): append each sample row's token to its row and its
 * stream (payload, fence, produced), then finish the rows that stop (reason, fence, state
 * word FINISHED; the row RELEASING). ``sample_rows``: the batch's, compacted first, -1 after.
 * ``done``: scratch, int64 [R]. */
void blink_sched_publish(int64_t R, const int64_t *sample_rows, const blink_sampled_t *out,
                         const blink_rows_t *st, const blink_ring_streams_t *ring, int64_t *done) {
    int64_t live_lanes = 0;
    while (live_lanes < R && sample_rows[live_lanes] >= 0)
        live_lanes++;
    /* The tokens table and the stream payload. */
    for (int64_t i = 0; i < live_lanes; i++) {
        int64_t r = sample_rows[i], tok = sampled_token(out, i);
        if (tok < 0) /* no structured-output mask arrived: nothing is published */
            continue;
        int64_t n = st->num_tokens[r];
        st->tokens[r * st->tokens_stride + n] = (int32_t)tok;
        st->num_tokens[r] = n + 1;
        int64_t at = ring->produced[r * ring->produced_stride] % ring->capacity;
        ring->tokens[r * ring->tokens_s0 + at * ring->tokens_s1] = (int32_t)tok;
        ring->logprob[r * ring->logprob_s0 + at * ring->logprob_s1] = out->logprob[i];
        if (out->width) {
            int32_t *ids = ring->top_ids + r * ring->top_ids_s0 + at * ring->top_ids_s1;
            float *lps = ring->top_logprobs + r * ring->top_logprobs_s0 + at * ring->top_logprobs_s1;
            for (int64_t k = 0; k < ring->num_top; k++) {
                int have = k < out->width;
                int64_t src = i * out->top_stride + k;
                ids[k] = !have ? -1 : (int32_t)(out->top_ids_are_64 ? ((const int64_t *)out->top_ids)[src]
                                                                    : ((const int32_t *)out->top_ids)[src]);
                lps[k] = have ? out->top_logprobs[src] : -__builtin_inff();
            }
        }
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    /* The produced counters, the finish checks and reasons. */
    int64_t published = 0, finished = 0;
    for (int64_t i = 0; i < live_lanes; i++) {
        int64_t r = sample_rows[i], tok = sampled_token(out, i);
        int no_mask = tok < 0, live = !no_mask;
        if (no_mask)
            tok = 0;
        int64_t *produced = ring->produced + r * ring->produced_stride;
        __atomic_store_n(produced, *produced + live, __ATOMIC_RELAXED);
        published += live;
        int64_t row_tokens = st->num_tokens[r]; /* after the token */
        int64_t n_out_before = row_tokens - live - st->num_prompt[r];
        int is_stop = 0, is_eos = 0;
        for (int64_t k = 0; k < st->n_stop; k++)
            is_stop |= st->stop_ids[r * st->stop_stride + k] == tok;
        for (int64_t k = 0; k < st->n_eos; k++)
            is_eos |= st->eos[k] == tok;
        int64_t max_t = st->max_tokens[r];
        int stop = live && (is_stop || (is_eos && st->ignore_eos[r] == 0)) && n_out_before >= st->min_tokens[r];
        int length = live && ((max_t > 0 && n_out_before + 1 >= max_t) || row_tokens >= st->max_model_len);
        if (stop || length || no_mask) {
            ring->finish_reason[r * ring->finish_stride] =
                (int32_t)(no_mask ? K[C_FINISH_ERROR] : stop ? K[C_FINISH_STOP] : K[C_FINISH_LENGTH]);
            done[finished++] = r;
        }
    }
    st->counters[K[C_K_GENERATED_TOKENS]] += published;
    if (!finished)
        return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    /* The FINISHED state words; the rows become RELEASING. */
    for (int64_t j = 0; j < finished; j++) {
        int64_t r = done[j];
        __atomic_store_n(ring->state_words + r, (int32_t)K[C_SLOT_FINISHED], __ATOMIC_RELAXED);
        st->status[r] = (int32_t)K[C_ROW_RELEASING];
        st->needs_lookup[r] = 0;
    }
}

/* ----------------------------------------------------------------- prefix-cache insert */

/* What the prefix-cache insert reads and writes (blink/engine/prefix_cache.py's names). */
typedef struct {
    int32_t *block_tokens;  /* [N + 1, B] */
    int64_t *row_hash;      /* [S, 2] */
    const int64_t *pows;    /* [2, pows_len]: BASES[m] ** i mod PRIMES[m] */
    int64_t pows_len;
    const int32_t *block_table; /* [S, M] */
    int64_t *hash_table;        /* [H + 1] */
    int64_t *block_slot, *block_key, *block_parent, *block_parent_gen;
    const int64_t *block_gen;
    const int32_t *block_ref;
    int64_t *block_last_used;
    const int64_t *arrival, *cache_salt; /* [S] */
    const int64_t *step;
    int64_t S, N, B, M, H, probes, collide; /* collide: every key 0 (tests) */
    int64_t primes[2];
} blink_prefix_t;

/* One block a step filled: where its insert goes. */
typedef struct {
    int64_t lane, row, j, key, parent;
    int64_t target; /* this round's slot; -1: not pending (taken, inserted, or out of rounds) */
    int64_t prio, victim, won, lost;
} fill_t;

/* prefix_cache.INSERT_ROUNDS */
#define INSERT_ROUNDS 3

/* prefix_cache._choose_slot for one key in round r: its slot in the probe window among those
 * no block took this step (on the table as the earlier rounds left it). A live entry of the
 * same key that is anchored keeps the block uncached (-1); else the first dead slot, else the
 * least recently used entry (those of free cached blocks first), "first" from the window's
 * start in round 0 and from a point the key picks in later rounds. -1 also when every slot
 * of the window was taken this step. */
static int64_t choose_slot(const blink_prefix_t *pc, const fill_t *fills, int64_t n_fills, int64_t key, int r) {
    const int64_t N = pc->N, H = pc->H, P = pc->probes;
    const int64_t rotate = r > 0 ? ((key / H) >> (3 * r)) % P : 0;
    int64_t best_score = 0, choice = -1;
    int taken = 0;
    for (int64_t k = 0; k < P; k++) {
        int64_t probe = (key % H + (k + rotate) % P) % H;
        int claimed = 0; /* nothing is taken before the first round's writes */
        for (int64_t i = 0; r > 0 && i < n_fills && !claimed; i++)
            claimed = fills[i].won == probe;
        if (claimed)
            continue;
        int64_t occupant = pc->hash_table[probe];
        int live = pc->block_slot[occupant] == probe;
        int same_key = live && pc->block_key[occupant] == key;
        int64_t up = pc->block_parent[occupant];
        int anchored = up == N || (pc->block_slot[up] >= 0 && pc->block_parent_gen[occupant] == pc->block_gen[up]);
        int64_t in_use = (int64_t)(pc->block_ref[occupant] > 0) << 62;
        int64_t score = same_key ? -2 : live ? pc->block_last_used[occupant] + in_use : -1;
        if (choice < 0 || score < best_score) {
            best_score = score;
            choice = probe;
            taken = same_key && anchored;
        }
    }
    return taken ? -1 : choice;
}

/* prefix_cache.register: record the step's tokens into their blocks, advance the rows'
 * prefix hashes, and insert every block the step filled into the table (the reference's
 * vectorised order: in each round every choice is made on the table as the round found it,
 * then the writes, phase by phase). Lanes [0, n) of the flat batch; lane t is a token when
 * t < *total. ``fills_scratch``: room for n fill_t (80 bytes each). Returns the blocks
 * inserted. */
int64_t blink_sched_register(
    int64_t n, const int64_t *input_ids, const int64_t *positions, const int64_t *rows,
    const int64_t *slot_mapping, const int64_t *total, const blink_prefix_t *pc, void *fills_scratch) {
    const int64_t N = pc->N, B = pc->B, M = pc->M;
    const int64_t *p = pc->primes;
    fill_t *fills = (fill_t *)fills_scratch;
    int64_t n_fills = 0, tokens = *total;
    for (int64_t t = 0; t < n; t++) /* token ids where their KV went (padding: the scratch block) */
        pc->block_tokens[slot_mapping[t]] = (int32_t)input_ids[t];
    /* Prefix hash at every token: the row's hash before the step + its terms so far. */
    int64_t run_row = -1, sum[2] = {0, 0};
    for (int64_t t = 0; t < tokens && t < n; t++) {
        int64_t row = rows[t], pos = positions[t];
        if (row != run_row) {
            if (run_row >= 0)
                for (int m = 0; m < 2; m++)
                    pc->row_hash[run_row * 2 + m] = (pc->row_hash[run_row * 2 + m] + sum[m]) % p[m];
            run_row = row;
            sum[0] = sum[1] = 0;
        }
        int64_t h[2];
        for (int m = 0; m < 2; m++) {
            sum[m] += (input_ids[t] + 1) * pc->pows[m * pc->pows_len + pos] % p[m];
            h[m] = (pc->row_hash[row * 2 + m] + sum[m]) % p[m];
        }
        if ((pos + 1) % B == 0) { /* this token completes its block */
            int64_t j = pos / B;
            int64_t key = pc->collide ? 0 : (h[0] << 31) | h[1];
            fill_t *f = &fills[n_fills++];
            f->lane = t;
            f->row = row;
            f->j = j;
            f->key = key ^ pc->cache_salt[row];
            f->parent = j > 0 ? (int64_t)pc->block_table[row * M + j - 1] : N;
        }
    }
    if (run_row >= 0)
        for (int m = 0; m < 2; m++)
            pc->row_hash[run_row * 2 + m] = (pc->row_hash[run_row * 2 + m] + sum[m]) % p[m];
    if (!n_fills)
        return 0;
    for (int64_t i = 0; i < n_fills; i++) {
        fills[i].prio = -(pc->arrival[fills[i].row] * (M + 1) + fills[i].j);
        fills[i].won = -1;
        fills[i].target = 0; /* pending */
    }
    /* Rounds, as the reference's: each pending block chooses a slot among those no block took
     * this step; the oldest request wins a contested slot; the winners' writes; a loser tries
     * again unless the winner holds its own key. */
    int64_t inserted = 0;
    const int64_t stamp = *pc->step * (M + 1);
    int64_t pending = n_fills;
    for (int round = 0; round < INSERT_ROUNDS && pending; round++) {
        for (int64_t i = 0; i < n_fills; i++)
            if (fills[i].target >= 0)
                fills[i].target = choose_slot(pc, fills, n_fills, fills[i].key, round);
        /* the winner is never marked lost, so every loser still meets it */
        for (int64_t i = 0; i < n_fills; i++) {
            fills[i].lost = fills[i].target < 0;
            for (int64_t k = 0; k < n_fills && !fills[i].lost; k++)
                if (k != i && fills[k].target == fills[i].target && fills[k].prio > fills[i].prio)
                    fills[i].lost = 1;
        }
        /* Phase by phase, as the reference's scatters: the evicted entries first (read on the
         * table before any write), then the new ones. */
        for (int64_t i = 0; i < n_fills; i++) {
            fill_t *f = &fills[i];
            f->victim = -1;
            if (!f->lost && pc->block_slot[pc->hash_table[f->target]] == f->target)
                f->victim = pc->hash_table[f->target];
        }
        for (int64_t i = 0; i < n_fills; i++)
            if (fills[i].victim >= 0)
                pc->block_slot[fills[i].victim] = -1;
        for (int64_t i = 0; i < n_fills; i++) {
            fill_t *f = &fills[i];
            if (f->lost)
                continue;
            int64_t blk = slot_mapping[f->lane] / B;
            pc->hash_table[f->target] = blk;
            pc->block_slot[blk] = f->target;
            pc->block_key[blk] = f->key;
            pc->block_parent[blk] = f->parent;
            pc->block_parent_gen[blk] = pc->block_gen[f->parent];
            if (pc->block_last_used[blk] < stamp)
                pc->block_last_used[blk] = stamp;
            f->won = f->target;
            inserted++;
        }
        pending = 0;
        for (int64_t i = 0; i < n_fills; i++) {
            fill_t *f = &fills[i];
            if (f->won >= 0)
                f->target = -1; /* done */
            else if (f->target >= 0 && pc->block_key[pc->hash_table[f->target]] == f->key)
                f->target = -1; /* the slot went to a block of its own key */
            pending += f->target >= 0;
        }
    }
    return inserted;
}

/* ------------------------------------------------------------------ budget and blocks */

/* What the allocation reads and writes (rows [0, S) of the window; blocks [0, N]). */
typedef struct {
    int32_t *status;
    const uint8_t *needs_lookup; /* torch.bool */
    const int64_t *num_tokens, *num_computed, *arrival;
    int64_t *num_blocks;
    const int64_t *produced, *consumed; /* the ring's, with their strides */
    int64_t produced_stride, consumed_stride;
    int32_t *block_ref;
    int64_t *block_slot, *block_last_used, *block_gen;
    int32_t *block_table; /* [S, M] */
    const int64_t *step;
    int64_t S, N, B, M, budget, capacity;
    int64_t *order, *grant, *need, *free_list; /* scratch: [S], [S], [S], [N] */
} blink_alloc_t;

static int64_t ceil_div64(int64_t x, int64_t d) { return (x + d - 1) / d; }

/* Scheduler._allocate (budget.py) under the FCFS policy when the step's new blocks fit the
 * free pool: each row in arrival order asks for its uncomputed tokens (none while its stream
 * is full or its prefix lookup is pending), the token budget is granted in that order, and
 * the new blocks come from the free pool, never-cached first (lowest id first), then cached
 * ones least recently used (lowest id among equals). Writes ``num_new`` [S] and returns 0;
 * returns 1 having written nothing when the blocks do not fit (preemption: the caller runs
 * the torch code, which decides it the same way). */
int64_t blink_sched_allocate(const blink_alloc_t *a, int64_t *num_new) {
    const int64_t S = a->S, N = a->N, B = a->B, M = a->M;
    int64_t n_active = 0;
    for (int64_t r = 0; r < S; r++) {
        int32_t s = a->status[r];
        if (s == K[C_ROW_WAITING] || s == K[C_ROW_RUNNING])
            a->order[n_active++] = r;
    }
    /* Arrival order (tickets are unique among live rows): an insertion sort, the live rows
     * being few and mostly in order already. */
    for (int64_t i = 1; i < n_active; i++) {
        int64_t r = a->order[i], k = i;
        while (k > 0 && a->arrival[a->order[k - 1]] > a->arrival[r]) {
            a->order[k] = a->order[k - 1];
            k--;
        }
        a->order[k] = r;
    }
    int64_t used = 0, needed = 0;
    for (int64_t r = 0; r < S; r++)
        a->grant[r] = a->need[r] = 0;
    for (int64_t i = 0; i < n_active; i++) {
        int64_t r = a->order[i];
        int room = a->produced[r * a->produced_stride] - a->consumed[r * a->consumed_stride] < a->capacity;
        int64_t want = !a->needs_lookup[r] && room ? a->num_tokens[r] - a->num_computed[r] : 0;
        int64_t left = a->budget - used;
        int64_t grant = left < 0 ? 0 : (want < left ? want : left);
        used += want; /* the budget's cumulative sum counts what each row asked for */
        int64_t need = ceil_div64(a->num_computed[r] + grant, B) - a->num_blocks[r];
        a->grant[r] = grant;
        a->need[r] = need > 0 ? need : 0;
        needed += a->need[r];
    }
    int64_t n_free = 0;
    for (int64_t b = 0; b < N && n_free < needed; b++) /* never-cached free blocks, by id */
        if (a->block_ref[b] == 0 && a->block_slot[b] < 0)
            a->free_list[n_free++] = b;
    int64_t wanted = needed - n_free, n_cached = 0;
    int64_t *lru = a->free_list + n_free;
    for (int64_t b = 0; b < N && wanted > 0; b++) { /* then cached free ones, least recently used */
        if (a->block_ref[b] != 0 || a->block_slot[b] < 0)
            continue;
        /* keep the ``wanted`` smallest (last used, id), sorted: ids ascend, so among equal
         * stamps the one already kept stays ahead */
        int64_t key = a->block_last_used[b];
        if (n_cached == wanted && key >= a->block_last_used[lru[n_cached - 1]])
            continue;
        int64_t k = n_cached < wanted ? n_cached++ : n_cached - 1; /* full: the last one goes */
        while (k > 0 && a->block_last_used[lru[k - 1]] > key) {
            lru[k] = lru[k - 1];
            k--;
        }
        lru[k] = b;
    }
    n_free += n_cached;
    if (n_free < needed)
        return 1;
    /* The new blocks, rows in index order, each row's at the end of its table. */
    const int64_t step = *a->step;
    int64_t lane = 0;
    for (int64_t r = 0; r < S; r++) {
        for (int64_t c = 0; c < a->need[r]; c++, lane++) {
            int64_t b = a->free_list[lane], col = a->num_blocks[r] + c;
            int64_t stamp = step * (M + 1) + (M - col);
            a->block_table[r * M + col] = (int32_t)b;
            a->block_ref[b] += 1;
            a->block_slot[b] = -1; /* evicted from the prefix cache */
            a->block_gen[b] += 1;  /* new content: its children are stale */
            if (a->block_last_used[b] < stamp)
                a->block_last_used[b] = stamp;
        }
        a->num_blocks[r] += a->need[r];
        num_new[r] = a->grant[r];
        if (a->grant[r] > 0)
            a->status[r] = (int32_t)K[C_ROW_RUNNING];
    }
    return 0;
}

/* ------------------------------------------------------------------- sampler's inputs */

/* One per-row field the sampler's inputs gather: row r of ``src`` to row i of ``dst``. */
typedef struct {
    const char *src;
    int64_t src_row_bytes;
    char *dst;
    int64_t row_bytes;
} blink_gather_t;

/* What the suppress list reads (rows of the whole table) and where it goes ([R, n_stop + n_eos]);
 * ``features``: the rows' sampler feature words (the plan's summary reads them). */
typedef struct {
    const int64_t *num_prompt, *num_tokens;
    const int32_t *stop_ids;
    int64_t stop_stride, n_stop;
    const int32_t *ignore_eos, *min_tokens;
    const int64_t *eos;
    int64_t n_eos;
    int32_t *suppress;
    const int32_t *features;
} blink_suppress_t;

/* Scheduler.sampler_inputs (batch.py): for lanes [0, R), the sample row's fields (the batch's
 * ``sample_rows``, of which ``n_lanes`` exist; missing or -1 lanes read row 0, as padding)
 * and its suppress list: the stop ids, then the EOS ids (-1 where the row ignores EOS), all
 * -1 once the row has ``min_tokens`` outputs. Returns what SamplerPlan.from_features reads
 * of these lanes: their feature words OR-ed, and 1 << 32 if any suppress id is set. */
int64_t blink_sched_sampler_inputs(int64_t R, const int64_t *sample_rows, int64_t n_lanes, int64_t n_fields,
                                   const blink_gather_t *fields, const blink_suppress_t *sp) {
    const int64_t width = sp->n_stop + sp->n_eos;
    uint32_t features = 0;
    int any_suppress = 0;
    for (int64_t i = 0; i < R; i++) {
        int64_t r = i < n_lanes && sample_rows[i] > 0 ? sample_rows[i] : 0;
        for (int64_t f = 0; f < n_fields; f++) {
            const blink_gather_t *g = &fields[f];
            const char *src = g->src + r * g->src_row_bytes;
            char *dst = g->dst + i * g->row_bytes;
            for (int64_t b = 0; b < g->row_bytes; b++)
                dst[b] = src[b];
        }
        int too_early = sp->num_tokens[r] - sp->num_prompt[r] < sp->min_tokens[r];
        int32_t *out = sp->suppress + i * width;
        for (int64_t k = 0; k < sp->n_stop; k++)
            out[k] = too_early ? sp->stop_ids[r * sp->stop_stride + k] : -1;
        for (int64_t k = 0; k < sp->n_eos; k++)
            out[sp->n_stop + k] = too_early && sp->ignore_eos[r] == 0 ? (int32_t)sp->eos[k] : -1;
        for (int64_t k = 0; k < width && !any_suppress; k++)
            any_suppress = out[k] >= 0;
        features |= (uint32_t)sp->features[r];
    }
    return (int64_t)features | (int64_t)any_suppress << 32;
}

/* --------------------------------------------------------------- compacted metadata */

/* blink/engine/step.py's compact_rows: the step's attention metadata cut down to the rows
 * with tokens this step (A of them, in row order) for its first n tokens: each token's row
 * renumbered among them, their query starts (and the end), context lengths and block tables.
 * Writes ``counts`` = (A, the longest context, the most new tokens of a row). */
void blink_sched_compact(int64_t S, int64_t n, int64_t M, const int64_t *num_new, const int64_t *token_seq_idx,
                         const int32_t *query_start_loc, const int32_t *seq_lens, const int32_t *block_table,
                         int64_t *seq_idx_out, int32_t *query_start_out, int32_t *seq_lens_out,
                         int32_t *tables_out, int64_t *remap, int64_t *counts) {
    int64_t A = 0, max_context = 0, max_query = 0;
    for (int64_t r = 0; r < S; r++) {
        remap[r] = 0;
        if (num_new[r] > max_query)
            max_query = num_new[r];
        if (num_new[r] <= 0)
            continue;
        remap[r] = A;
        query_start_out[A] = query_start_loc[r];
        seq_lens_out[A] = seq_lens[r];
        if (seq_lens[r] > max_context)
            max_context = seq_lens[r];
        for (int64_t c = 0; c < M; c++)
            tables_out[A * M + c] = block_table[r * M + c];
        A++;
    }
    query_start_out[A] = query_start_loc[S];
    for (int64_t t = 0; t < n; t++)
        seq_idx_out[t] = remap[token_seq_idx[t]];
    counts[0] = A;
    counts[1] = max_context;
    counts[2] = max_query;
}

/* ------------------------------------------------------------------ the step's guards */

/* Scheduler.schedule's opening (scheduler.py): the step's snapshot of the ring's state words
 * (``ring_state``, written by the frontend at any time) into ``slot_state``, each word read
 * once, then a full fence (acquire: a payload the words publish is read after them), the step
 * counters, the row window (the smallest of ``window_sizes`` holding every row not EMPTY and
 * every slot the frontend has written) and the stage guards over it. ``out``: the window's
 * size, then whether a live row is cancelled, a row is RELEASING, a WRITTEN slot has an EMPTY
 * row, a row waits for its prefix lookup. */
void blink_sched_begin_step(int64_t S, const int32_t *status, const int32_t *ring_state, int32_t *slot_state,
                            const int32_t *cancel, int64_t cancel_stride, const uint8_t *needs_lookup,
                            const int64_t *window_sizes, int64_t n_sizes, int64_t *step, int64_t *counters,
                            int64_t *out) {
    for (int64_t r = 0; r < S; r++)
        slot_state[r] = __atomic_load_n(&ring_state[r], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* memory_fence: mfence / dmb ish */
    *step += 1;
    counters[K[C_K_STEPS]] += 1;
    int64_t last = -1;
    for (int64_t r = 0; r < S; r++)
        if (status[r] != K[C_ROW_EMPTY] || slot_state[r] == K[C_SLOT_WRITTEN])
            last = r;
    int64_t size = window_sizes[n_sizes - 1];
    for (int64_t i = 0; i < n_sizes; i++)
        if (window_sizes[i] >= last + 1) {
            size = window_sizes[i];
            break;
        }
    int64_t cancelled = 0, releasing = 0, admissible = 0, lookup = 0;
    for (int64_t r = 0; r < size; r++) {
        int32_t s = status[r];
        cancelled |= cancel[r * cancel_stride] != 0 && (s == K[C_ROW_WAITING] || s == K[C_ROW_RUNNING]);
        releasing |= s == K[C_ROW_RELEASING];
        admissible |= slot_state[r] == K[C_SLOT_WRITTEN] && s == K[C_ROW_EMPTY];
        lookup |= needs_lookup[r] != 0;
    }
    out[0] = size;
    out[1] = cancelled;
    out[2] = releasing;
    out[3] = admissible;
    out[4] = lookup;
}

/* -------------------------------------------------------------------------- layout */

/* The sizes of the structures sched.py mirrors with ctypes, in its order (a field added on
 * one side only is refused at load, not misread). Returns how many it wrote. */
int64_t blink_sched_struct_sizes(int64_t *out, int64_t n) {
    const int64_t sizes[] = {
        sizeof(blink_ring_streams_t), sizeof(blink_sampled_t), sizeof(blink_rows_t), sizeof(blink_prefix_t),
        sizeof(fill_t), sizeof(blink_alloc_t), sizeof(blink_gather_t), sizeof(blink_suppress_t)};
    const int64_t count = (int64_t)(sizeof(sizes) / sizeof(sizes[0]));
    for (int64_t i = 0; i < n && i < count; i++)
        out[i] = sizes[i];
    return count;
}
