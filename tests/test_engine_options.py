"""The engine's knobs are declared once (blink/engine_options.py, issue 31): the flags, what
``blink serve`` hands on to its engine children and EngineConfig's fields all come from that
table. Nothing here starts an engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from blink.cli import build_parser, parse_args
from blink.engine_options import (
    ENGINE_OPTIONS,
    MODEL_GROUP,
    PROCESS_GROUP,
    SHARED_SERVE_FLAGS,
    VLLM_GROUP,
    EngineOption,
    config_default,
)
from blink.launcher import engine_child_argv, engine_config_from_args

HELP_SNAPSHOT = Path(__file__).parent / "fixtures" / "engine_options_help.json"
#: flags ``blink serve`` and ``blink engine`` share that blink serve does not hand on as they
#: are, and why
NOT_HANDED_ON = {
    "help": "each command has its own",
    "config": "blink serve has merged the file's values into its flags already",
    "bootstrap_secret_file": "the secret reaches the children in $BLINK_BOOTSTRAP_SECRET",
    "fabric": "blink serve hands its --fabric to each prefill engine with its --fabric-sender",
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def _sample(option: EngineOption):
    """A value of ``option`` other than its default."""
    if option.example is not None:
        return option.example
    kw = option.argparse
    if kw.get("action") == "store_true":
        return True
    if kw.get("action") == "store_false":
        return False
    if kw.get("choices"):
        return next(c for c in kw["choices"] if c != option.default)
    if kw.get("type") is int:
        return (option.default or 0) + 3
    if kw.get("type") is float:
        return (option.default or 0) + 0.5
    return "/tmp/blink-example"


def test_every_engine_config_field_a_flag_sets_is_declared_once():
    from blink.engine.engine import EngineConfig
    from blink.engine.token_mask import DEFAULT_MASK_TIMEOUT_S

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    declared = [o.field for o in ENGINE_OPTIONS if o.field is not None]
    assert len(declared) == len(set(declared)), "one declaration per EngineConfig field"
    for name in declared:
        assert name in fields, f"{name}: declared in blink/engine_options.py, not in EngineConfig"
    for name in declared:
        if name == "enforce_eager":  # neither flag given: $BLINK_ENFORCE_EAGER decides
            continue
        assert fields[name].default == config_default(name), name
    assert config_default("mask_timeout_s") == DEFAULT_MASK_TIMEOUT_S
    # Parsing no flags gives EngineConfig's defaults, for both commands.
    for command in ("serve", "engine"):
        assert engine_config_from_args(parse_args([command])) == EngineConfig()


def test_an_option_either_reaches_the_engine_child_or_says_why_not():
    for o in ENGINE_OPTIONS:
        assert o.forward or o.not_forwarded, o.flags
        if o.field is not None and o.group != PROCESS_GROUP:
            assert o.forward, f"{o.flags[0]} sets EngineConfig.{o.field} but blink serve " \
                              f"does not hand it on to its engine"


@pytest.mark.parametrize("option", [o for o in ENGINE_OPTIONS if o.forward],
                         ids=lambda o: o.flags[0])
def test_blink_serve_hands_each_engine_flag_on(option):
    """``blink serve FLAG VALUE``: the engine child's command line parses to the same value
    and the same EngineConfig as ``blink serve``'s own."""
    # (without them blink serve picks thread counts for its children: see the test below)
    counts = [f for name in ("--threads", "--kernel-threads") if name not in option.flags
              for f in (name, "1")]
    serve = parse_args(["serve", *counts, *option.argv(_sample(option))])
    assert getattr(serve, option.dest) != option.default
    engine = parse_args(["engine", *engine_child_argv(serve)])
    assert getattr(engine, option.dest) == getattr(serve, option.dest)
    assert engine_config_from_args(engine) == engine_config_from_args(serve)


def test_every_flag_the_engine_takes_from_serve_is_handed_on():
    """Walk ``blink engine``'s flags: each one ``blink serve`` also has reaches the child
    (a declaration with ``forward``, or SHARED_SERVE_FLAGS) or is listed here with why not."""
    subs = _subparsers()
    serve_dests = {a.dest for a in subs["serve"]._actions}
    handed_on = {o.dest for o in ENGINE_OPTIONS if o.forward} | set(SHARED_SERVE_FLAGS)
    not_forwarded = {o.dest for o in ENGINE_OPTIONS if not o.forward}
    for action in subs["engine"]._actions:
        if action.dest not in serve_dests:
            continue
        assert action.dest in handed_on | not_forwarded | set(NOT_HANDED_ON), (
            f"blink engine's {action.option_strings} is also a blink serve flag, but blink "
            f"serve does not hand it on: declare it in blink/engine_options.py")
    argv = engine_child_argv(parse_args(["serve", "--log-level", "debug",
                                         "--thread-policy", "off"]))
    assert argv[argv.index("--log-level") + 1] == "debug"
    assert argv[argv.index("--thread-policy") + 1] == "off"


def test_serve_picks_the_children_thread_counts_only_where_not_given(monkeypatch):
    import blink.launcher as launcher

    monkeypatch.setattr(launcher, "_cores", lambda: 5)
    argv = engine_child_argv(parse_args(["serve"]), engines=2)
    assert argv[argv.index("--threads") + 1] == "2"  # (5 - 1) // 2
    assert argv[argv.index("--kernel-threads") + 1] == "2"  # 5 // 2
    argv = engine_child_argv(parse_args(["serve", "--threads", "3", "--kernel-threads", "4"]))
    assert argv.count("--threads") == argv.count("--kernel-threads") == 1
    assert argv[argv.index("--threads") + 1] == "3"
    assert argv[argv.index("--kernel-threads") + 1] == "4"


def _describe(parser: argparse.ArgumentParser, groups: tuple[str, ...]) -> list[dict]:
    out = []
    for group in parser._action_groups:
        if group.title not in groups:
            continue
        for a in group._group_actions:
            out.append({"group": group.title, "flags": list(a.option_strings), "dest": a.dest,
                        "default": repr(a.default),
                        "choices": None if a.choices is None else [str(c) for c in a.choices],
                        "type": getattr(a.type, "__name__", None), "nargs": a.nargs,
                        "metavar": a.metavar, "action": type(a).__name__, "help": a.help})
    return out


def _engine_help() -> dict:
    subs = _subparsers()
    groups = (MODEL_GROUP, VLLM_GROUP)
    engine = _describe(subs["engine"], ("options",))
    process = {f for o in ENGINE_OPTIONS if o.group == PROCESS_GROUP for f in o.flags}
    return {"serve": _describe(subs["serve"], groups),
            "engine": _describe(subs["engine"], groups),
            "engine process": [a for a in engine if set(a["flags"]) & process]}


def test_help_of_the_engine_flags_is_unchanged():
    """The flags, defaults, choices and help texts of the engine's knobs, as ``--help`` shows
    them, are those of the hand-written parser they replaced (snapshot taken before). A
    deliberate change: regenerate with ``python tests/test_engine_options.py``."""
    assert _engine_help() == json.loads(HELP_SNAPSHOT.read_text())


def test_help_text_of_serve_still_names_every_engine_flag():
    text = _subparsers()["serve"].format_help()
    for o in ENGINE_OPTIONS:
        if o.group != PROCESS_GROUP and o.argparse.get("help") is not argparse.SUPPRESS:
            assert o.flags[0] in text


def test_every_vllm_flag_is_in_the_migration_table():
    """A flag declared as ``vllm serve``'s (or as answering to one of its flags) is in
    docs/vllm-migration.md, which vLLM users read."""
    from blink.engine_options import SAME_AS_VLLM, VLLM_MIGRATION_DOC

    doc = (Path(__file__).resolve().parents[1] / VLLM_MIGRATION_DOC).read_text()
    missing = [o.flags[0] if o.vllm == SAME_AS_VLLM else o.vllm
               for o in ENGINE_OPTIONS if o.vllm
               and (o.flags[0] if o.vllm == SAME_AS_VLLM else o.vllm) not in doc]
    assert not missing, f"not in {VLLM_MIGRATION_DOC}: {missing}"


def test_ring_and_scheduler_configs_are_derived_from_the_engine_config():
    """The sizes EngineConfig holds reach the ring's and the scheduler's configs through
    EngineConfig.ring_config / scheduler_config, not restated at the call site."""
    from blink.engine.engine import EngineConfig
    from blink.ring import mask_words_for

    config = engine_config_from_args(parse_args([
        "engine", "--max-num-seqs", "8", "--max-logprobs", "3", "--block-size", "32",
        "--max-num-batched-tokens", "256", "--structured-mask-timeout", "2", "--role", "decode"]))
    ring = config.ring_config(max_model_len=1000, vocab_size=49152)
    assert (ring.n_slots, ring.max_logprobs, ring.max_model_len) == (8, 3, 1000)
    assert ring.mask_words == mask_words_for(49152) and ring.max_kv_blocks == 32  # ceil(1000/32)
    sched = config.scheduler_config(num_blocks=64, max_model_len=1000, eos_token_ids=[2])
    assert (sched.block_size, sched.num_blocks, sched.max_num_batched_tokens) == (32, 64, 256)
    assert sched.mask_timeout_s == 2.0 and sched.eos_token_ids == (2,)
    assert sched.enable_prefix_caching is False  # a decode engine's rows have no hash chain
    both = EngineConfig(structured_outputs=False)
    assert both.ring_config(max_model_len=64, vocab_size=100).mask_words == 0
    assert both.ring_config(max_model_len=64, vocab_size=100).max_kv_blocks == 0
    assert both.scheduler_config(num_blocks=8, max_model_len=64,
                                 eos_token_ids=()).enable_prefix_caching is True


def test_removed_flag_is_refused_by_serve_too():
    from blink.cli_args import check_vllm_flags
    from blink.errors import BlinkError

    with pytest.raises(BlinkError, match="--grammar-region-mb was removed"):
        check_vllm_flags(parse_args(["serve", "--grammar-region-mb", "4"]))


if __name__ == "__main__":
    HELP_SNAPSHOT.write_text(json.dumps(_engine_help(), indent=1) + "\n")
    print(f"wrote {HELP_SNAPSHOT}")
