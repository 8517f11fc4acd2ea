"""The C ABI of the CPU kernel libraries, declared once.

One table per library (its ``.c`` source and the ``kernels.h`` it includes): every exported
function's return type and its arguments, named as the C source names them, in order. ctypes
trusts what it is told, so a table that disagrees with the C (one argument too few, an
``int`` for an ``int64_t``) is a silent memory bug; ``tests/test_cpu_abi.py`` parses the C
sources' exported definitions and checks each table against them: the functions, and each
one's return type and arguments (count, order, names, types).

Pointers are ``c_void_p`` whatever they point to (the wrappers pass ``tensor.data_ptr()``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@dataclass(frozen=True)
class Signature:
    """One exported C function: its return type (None: void) and its ``(name, ctype)``
    arguments in order."""

    restype: type | None
    args: tuple[tuple[str, type], ...] = ()

    @property
    def argtypes(self) -> list[type]:
        return [ctype for _, ctype in self.args]


def _args(spec: str, ctype: type) -> tuple[tuple[str, type], ...]:
    """``"a b c"`` -> three arguments of one type (a run of the C's parameter list)."""
    return tuple((name, ctype) for name in spec.split())


#: what every library that includes kernels.h exports
KERNELS_H: dict[str, Signature] = {
    "blink_has_avx512": Signature(INT),
    "blink_use_pool": Signature(None, _args("run", P)),
}

#: pool.c: the process's worker pool (only blink_pool_split's address is used: each kernel
#: library gets it through blink_use_pool)
POOL: dict[str, Signature] = {
    **KERNELS_H,
    "blink_pool_split": Signature(INT, _args("run args", P) + _args("items", I64) + _args("threads", INT)
                                  + _args("parts", I64)),
}

#: attention.c: the paged attention
ATTENTION: dict[str, Signature] = {
    **KERNELS_H,
    "blink_paged_attention_tile_min_tokens": Signature(INT),
    "blink_paged_attention_tiles_on_amx": Signature(INT),
    "blink_paged_attention_allow_amx": Signature(None, _args("allowed", INT)),
    "blink_paged_attention": Signature(
        INT,
        _args("q", P) + _args("q_stride_t q_stride_h", I64) + _args("out k v", P)
        + _args("q_bf16 kv_bf16", INT) + _args("T H KVH D block_size num_blocks rows", I64)
        + _args("token_row positions query_start seq_lens tables", P)
        + _args("table_stride table_cols", I64) + _args("scale", F32) + _args("threads", INT)),
}

#: fused.c: the eager forward's elementwise ops, the sampler's log-normaliser (and greedy token), the token mask
FUSED: dict[str, Signature] = {
    **KERNELS_H,
    "blink_has_vector_ops": Signature(INT),
    "blink_write_kv": Signature(
        INT,
        _args("k", P) + _args("k_stride", I64) + _args("v", P) + _args("v_stride", I64)
        + _args("k_cache v_cache slot_mapping", P) + _args("tokens row slots", I64) + _args("threads", INT)),
    "blink_add_rms_norm": Signature(
        None,
        _args("x", P) + _args("x_stride", I64) + _args("residual", P) + _args("res_stride", I64)
        + _args("weight out residual_out", P) + _args("rows dim", I64) + _args("eps", F32)
        + _args("threads", INT)),
    "blink_rope": Signature(
        INT,
        _args("q", P) + _args("q_stride", I64) + _args("k", P) + _args("k_stride", I64)
        + _args("positions cos_sin", P) + _args("max_positions", I64) + _args("out", P)
        + _args("tokens H KVH D rotary_dim", I64) + _args("threads", INT)),
    "blink_silu_and_mul": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("out", P) + _args("rows dim", I64) + _args("threads", INT)),
    "blink_logsumexp_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("out", P) + _args("rows cols", I64) + _args("threads", INT)),
    "blink_argmax_logsumexp_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("argmax out logprob", P) + _args("rows cols", I64)
        + _args("threads", INT)),
    "blink_argmax_logsumexp_rows_bf16": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("argmax out logprob", P) + _args("rows cols", I64)
        + _args("threads", INT)),
    "blink_token_mask_rows": Signature(
        None,
        _args("x", P) + _args("x_stride", I64) + _args("words", P) + _args("w_stride n_words", I64)
        + _args("slot mode out", P) + _args("rows cols", I64) + _args("threads", INT)),
    "blink_step_inputs_size": Signature(I64),
    "blink_step_inputs": Signature(INT, _args("s", P)),
}

#: sampling.c: the sampler's penalties, seeded draw and top-k / top-p / min-p filter, and the
#: prompt logprobs' per-position numbers (blink.kernels.cpu.sampling)
SAMPLING: dict[str, Signature] = {
    **KERNELS_H,
    "blink_sample_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("seeds counters out", P) + _args("rows cols", I64)
        + _args("threads", INT)),
    "blink_sampling_reserve": Signature(INT, _args("n", I64) + _args("count", INT)),
    "blink_top_rows": Signature(
        None, _args("x", P) + _args("x_stride k", I64) + _args("values ids", P) + _args("rows cols", I64)
        + _args("threads", INT)),
    "blink_prompt_logprobs_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("targets", P) + _args("top_n", I64)
        + _args("chosen rank top_lp top_ids", P) + _args("rows cols", I64) + _args("threads", INT)),
    "blink_uniform_rows": Signature(None, _args("seeds counters out", P) + _args("rows cols", I64)),
    "blink_gumbel_rows": Signature(None, _args("seeds counters out", P) + _args("rows cols", I64)),
    "blink_penalties_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("ids", P) + _args("ids_stride length", I64)
        + _args("prompt_lens total_lens rep pres freq out", P) + _args("rows cols", I64)
        + _args("threads", INT)),
    "blink_filter_rows": Signature(
        None, _args("x", P) + _args("x_stride", I64) + _args("top_k top_p min_p out", P)
        + _args("rows cols", I64) + _args("threads", INT)),
}

_LINEAR_ARGS = (_args("x", P) + _args("x_stride", I64) + _args("codes scales bias y", P)
                + _args("y_stride M N K", I64))

#: q4_linear.c: 4-bit (and 8-bit) projections on AMX
Q4_LINEAR: dict[str, Signature] = {
    **KERNELS_H,
    "blink_q4_linear_supported": Signature(INT),
    "blink_q4_linear_few_rows": Signature(INT),
    "blink_q4_linear": Signature(INT, _LINEAR_ARGS + _args("threads", INT)),
    "blink_q4_linear_gated": Signature(INT, _LINEAR_ARGS + _args("threads", INT)),
    "blink_q8_linear": Signature(INT, _LINEAR_ARGS + _args("threads", INT)),
}

#: quant_linear.c: 4-/8-bit projections on AVX-512 BF16 or AVX2 (one source, two builds)
QUANT_LINEAR: dict[str, Signature] = {
    **KERNELS_H,
    "blink_quant_linear_isa": Signature(INT),
    "blink_quant_linear": Signature(INT, _LINEAR_ARGS + _args("format threads", INT)),
}

#: sched.c: the scheduler's per-step stages for the CPU loop (blink.kernels.cpu.sched)
SCHED: dict[str, Signature] = {
    "blink_sched_constants": Signature(INT, _args("values", P) + _args("n", I64)),
    "blink_sched_struct_sizes": Signature(I64, _args("out", P) + _args("n", I64)),
    "blink_sched_build_batch": Signature(
        I64,
        _args("S T N B M host_lanes", I64) + _args("num_new num_computed num_tokens tokens", P)
        + _args("tokens_stride", I64) + _args("block_table buckets", P) + _args("n_buckets", I64)
        + _args("input_ids positions seq_idx slot_mapping query_start_loc seq_lens total_out bucket_out "
                "sample_rows num_sample_rows logits_indices", P)),
    "blink_sched_write_stats": Signature(
        None,
        _args("S N", I64) + _args("status ring_state", P) + _args("state_stride", I64)
        + _args("block_ref counters control stat_words", P)),
    "blink_sched_publish": Signature(
        None, _args("R", I64) + _args("sample_rows out st ring done", P)),
    "blink_sched_register": Signature(
        I64, _args("n", I64) + _args("input_ids positions rows slot_mapping total pc fills_scratch", P)),
    "blink_sched_allocate": Signature(I64, _args("a num_new", P)),
    "blink_sched_begin_step": Signature(
        None, _args("S", I64) + _args("status ring_state slot_state cancel", P) + _args("cancel_stride", I64)
        + _args("needs_lookup window_sizes", P) + _args("n_sizes", I64) + _args("step counters out", P)),
    "blink_sched_compact": Signature(
        None, _args("S n M", I64) + _args("num_new token_seq_idx query_start_loc seq_lens block_table seq_idx_out "
                                          "query_start_out seq_lens_out tables_out remap counts", P)),
    "blink_sched_sampler_inputs": Signature(
        I64, _args("R", I64) + _args("sample_rows", P) + _args("n_lanes n_fields", I64) + _args("fields sp", P)),
}

#: replay.c: a CPU graph's recorded calls made from C (blink.kernels.cpu.graph), its
#: source generated from the tables above (:func:`replay_source`)
REPLAY: dict[str, Signature] = {
    "blink_replay": Signature(I64, _args("calls", P) + _args("n", I64) + _args("args status", P)),
}

#: libraries no CPU graph records (the scheduler's stages act on the values they read; the
#: sampler runs eagerly after the forward's graph), so replay.c needs no thunk for them
NOT_RECORDED = frozenset({"sched.c", "sampling.c"})

#: each library's source (beside this module) -> its table
LIBRARIES: dict[str, dict[str, Signature]] = {
    "pool.c": POOL,
    "attention.c": ATTENTION,
    "fused.c": FUSED,
    "q4_linear.c": Q4_LINEAR,
    "quant_linear.c": QUANT_LINEAR,
    "replay.c": REPLAY,
    "sampling.c": SAMPLING,
    "sched.c": SCHED,
}


def declare(library: ctypes.CDLL, table: dict[str, Signature]) -> None:
    """Set every function of ``table`` on ``library``: its restype and argtypes."""
    for name, signature in table.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = signature.restype, signature.argtypes


# ------------------------------------------------------------------ replay.c, generated

#: each ctype the tables use -> its C type and the blink_arg_t member that holds it
_REPLAY_TYPES: dict[type, tuple[str, str]] = {P: ("void *", "p"), I64: ("int64_t", "i"),
                                              INT: ("int", "i"), F32: ("float", "f")}


def replay_signatures() -> list[tuple[type | None, tuple[type, ...]]]:
    """Every distinct ``(restype, argtypes)`` of the tables' functions, in table order:
    replay.c's thunk ``i`` calls a function of signature ``i`` (:func:`replay_source`)."""
    found: list[tuple[type | None, tuple[type, ...]]] = []
    for source, table in LIBRARIES.items():
        if source in NOT_RECORDED:
            continue
        for signature in table.values():
            key = (signature.restype, tuple(signature.argtypes))
            if key not in found:
                found.append(key)
    return found


def replay_source() -> str:
    """replay.c's text: one thunk per signature of :func:`replay_signatures` that calls a
    function pointer through its exact prototype, and ``blink_replay``, which makes a CPU
    graph's calls in order from arrays (kernels/cpu/graph.py builds them). Generated, so that
    the prototypes cannot drift from these tables (which tests/test_cpu_abi.py checks against
    the C); tests/test_cpu_abi.py also checks that replay.c is this text."""
    thunks = []
    for i, (restype, argtypes) in enumerate(replay_signatures()):
        c_args = ", ".join(_REPLAY_TYPES[t][0] for t in argtypes) or "void"
        values = ", ".join(f"a[{k}].{_REPLAY_TYPES[t][1]}" if t is not INT else f"(int)a[{k}].i"
                           for k, t in enumerate(argtypes))
        c_ret = "void" if restype is None else _REPLAY_TYPES[restype][0]
        call = f"(({c_ret} (*)({c_args}))fn)({values})"
        body = (f"{call};\n    return 0;" if restype is None
                else f"return (int64_t)(intptr_t){call};" if restype is P else f"return (int64_t){call};")
        unused = "" if argtypes else "    (void)a;\n"  # a thunk of no arguments reads none
        thunks.append(f"static int64_t thunk_{i}(const void *fn, const blink_arg_t *a) {{\n"
                      f"{unused}    {body}\n}}\n")
    table = ",\n    ".join(f"thunk_{i}" for i in range(len(thunks)))
    return f"""/* GENERATED from kernels/cpu/abi.py's tables by `python -m blink.kernels.cpu.abi > kernels/cpu/replay.c`:
 * do not edit (tests/test_cpu_abi.py fails when this file is not what abi.replay_source() writes).
 *
 * A CPU graph's replay (kernels/cpu/graph.py) in C: the recorded kernel calls, made in order
 * with the arguments recorded, in one call from Python instead of one ctypes call each (a
 * decode step of SmolLM2-135M makes ~270). A call is a function pointer, the index of the
 * thunk that calls it through its exact prototype (one per distinct signature in the tables),
 * whether it returns a status (0: done), and where its arguments start in one array.
 */
#include <stdint.h>

typedef union {{
    void *p;
    int64_t i; /* int64_t and int arguments (an int is passed as (int)i) */
    float f;
}} blink_arg_t;

typedef struct {{
    const void *fn;
    int64_t thunk;   /* index in THUNKS */
    int64_t checked; /* returns a status: nonzero stops the replay */
    int64_t first;   /* its first argument's index in the arguments array */
}} blink_call_t;

{chr(10).join(thunks)}
static int64_t (*const THUNKS[])(const void *, const blink_arg_t *) = {{
    {table},
}};

/* Make calls[0..n) in order. Returns -1 when every call is done, else the index of the
 * first call that returned a nonzero status (written to *status), after which none runs. */
int64_t blink_replay(const void *calls, int64_t n, const void *args, void *status) {{
    const blink_call_t *c = (const blink_call_t *)calls;
    const blink_arg_t *a = (const blink_arg_t *)args;
    for (int64_t i = 0; i < n; i++) {{
        const int64_t s = THUNKS[c[i].thunk](c[i].fn, a + c[i].first);
        if (c[i].checked && s != 0) {{
            *(int64_t *)status = s;
            return i;
        }}
    }}
    return -1;
}}
"""


if __name__ == "__main__":
    print(replay_source(), end="")
