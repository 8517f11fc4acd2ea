"""Chat-template rendering, compatible with transformers' ``apply_chat_template``.

Chat templates come from model repositories, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` with the same globals and filters transformers provides
(``raise_exception``, ``strftime_now``, a non-escaping ``tojson``, ``namespace``), so any
template that renders under transformers renders the same here.

The sandbox stops attribute escapes, not runaway work, so every render also runs under a
:class:`RenderLimits` budget: a wall-clock deadline, checked on every call (macros included)
and at the top of every loop body (an injected tick call); and a size cap that refuses, *before* allocating,
any string or list a ``*``, ``**``, ``%``, width-taking method or filter, namespace
assignment or macro argument would make
bigger than the cap, and stops the output once it passes the cap. Exceeding either raises
:class:`TemplateLimitError` (a :class:`ChatTemplateError`), and so does anything else a template
raises: a template error is the request's fault, never a server error.

Message content may be a string or a list of ``{"type": "text", "text": ...}`` parts. Templates
written for plain strings get the parts joined with newlines (vLLM's "string" content format);
templates that iterate over ``message['content']`` get the list as is ("openai" format).
"""
from __future__ import annotations

import functools
import json
import re
import string
import threading
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

# transformers appends this to the final message for continue_final_message, then cuts the
# rendering at it: robust even when the same text occurs earlier in the conversation.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


#: Default wall-clock budget of one render. A real chat template renders in well under a
#: millisecond; half a second leaves room for a loaded machine and huge conversations.
DEFAULT_RENDER_TIMEOUT_S = 0.5
#: Default cap on the rendered text and on any string or list built while rendering.
DEFAULT_MAX_RENDER_CHARS = 1 << 22
#: Items one ``range()`` may produce (jinja's sandbox uses the same bound).
MAX_RANGE = 100_000
# ints from a template may not grow past this many bits (``2 ** 10**9`` would take minutes)
_MAX_INT_BITS = 1 << 16
# how often (in trace events) to read the clock: cheap enough, fine-grained enough
_TICKS_PER_CLOCK_READ = 64
# a %-format conversion's width and precision ("%-08.3f", "%*d", "%(name)5s")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
# the global _LoopTick calls in every loop body
_TICK_NAME = "_blink_render_tick"


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (bad messages, or the template raised)."""


class TemplateLimitError(ChatTemplateError):
    """A render ran past its deadline or tried to build more text than allowed."""


class RenderedTooLongError(TemplateLimitError):
    """The rendered text itself passed ``RenderLimits.max_chars`` (a conversation too long for
    the context, when the cap is the prompt-length bound)."""

    def __init__(self, size: int, max_chars: int) -> None:
        super().__init__(f"the rendered prompt has more than {max_chars} characters "
                         f"({size} so far)")
        self.size = size
        self.max_chars = max_chars


@dataclass(frozen=True)
class RenderLimits:
    """The budget of one render: wall-clock seconds, and the most characters the output (or
    any string or list built on the way) may have."""

    timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    max_chars: int = DEFAULT_MAX_RENDER_CHARS


class _Budget:
    """The running render's deadline and size cap; one per render, held per thread."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.max_chars = limits.max_chars
        self.deadline = time.monotonic() + limits.timeout_s
        self._ticks = 0

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks % _TICKS_PER_CLOCK_READ == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"the chat template did not finish rendering within "
                f"{self.limits.timeout_s:g} s")

    def check_size(self, n: int, what: str = "the rendered text") -> None:
        if n > self.max_chars:
            raise TemplateLimitError(
                f"the chat template would build {what} of {n} characters or items; at most "
                f"{self.max_chars} are allowed")

    def check_value(self, value: Any) -> None:
        if isinstance(value, (str, list, tuple, dict)):
            self.check_size(len(value), "a value")

    def check_int_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        # A width, count or padding larger than the whole output cap can only build something
        # larger than the cap (center(10**9), batch(10**9), ljust(10**9), lipsum(10**9)...).
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and \
                    abs(value) > self.max_chars:
                self.check_size(abs(value), "a value")

    def check_percent_format(self, fmt: str, args: Any) -> None:
        """``fmt % args``: widths and precisions are output sizes; none may exceed the cap
        (``*`` takes them from ``args``, whose ints are checked too)."""
        for width, precision in _PERCENT_SPEC.findall(fmt):
            for digits in (width, precision):
                if digits and digits != "*":
                    self._check_width(digits)
        values = args if isinstance(args, tuple) else (args,)
        self.check_int_args(values, {})

    def check_str_format(self, fmt: str) -> None:
        """``fmt.format(...)``: the widths in its replacement fields are output sizes (nested
        ``{:{}}`` widths come from the arguments, checked by the call hook)."""
        try:
            fields = list(string.Formatter().parse(fmt))
        except ValueError:
            return  # str.format reports the malformed string itself
        for _, _, spec, _ in fields:
            for digits in re.findall(r"\d+", spec or ""):
                self._check_width(digits)

    def _check_width(self, digits: str) -> None:
        if len(digits) > 18 or int(digits) > self.max_chars:
            self.check_size(int(digits[:19]), "a formatted value")

    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        sized = (str, list, tuple)
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(count, int):
                    self.check_size(len(seq) * max(count, 0), "a repeated value")
            if isinstance(left, int) and isinstance(right, int):
                self._check_bits(left.bit_length() + right.bit_length())
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                self._check_bits(right * max(abs(left), 1).bit_length())
        elif operator == "%" and isinstance(left, str):
            self.check_percent_format(left, right)

    def _check_bits(self, bits: int) -> None:
        if bits > _MAX_INT_BITS:
            raise TemplateLimitError(
                f"the chat template would build an integer of about {bits} bits; at most "
                f"{_MAX_INT_BITS} are allowed")


_current = threading.local()


def _budget() -> _Budget | None:
    return getattr(_current, "budget", None)


def _render_tick() -> str:
    """Called at the top of every ``for`` body (see :class:`_LoopTick`); the call itself goes
    through :meth:`_LimitedEnvironment.call`, which reads the clock."""
    return ""


class _LoopTick(jinja2.ext.Extension):
    """Puts ``{{ _blink_render_tick() }}`` at the top of every ``for`` body: a loop that calls
    nothing (nested loops over a long string) would otherwise never meet the deadline. The
    call renders as ""; shadowing the name does not help a template, since any call is
    checked."""

    def filter_stream(self, stream: jinja2.lexer.TokenStream) -> Iterator[jinja2.lexer.Token]:
        after_block_begin = in_for = False
        for token in stream:
            yield token
            if token.type == "block_begin":
                after_block_begin = True
                continue
            if after_block_begin:
                in_for = token.type == "name" and token.value == "for"
                after_block_begin = False
            if token.type == "block_end" and in_for:
                in_for = False
                Token = jinja2.lexer.Token
                for kind, value in (("variable_begin", "{{"), ("name", _TICK_NAME),
                                    ("lparen", "("), ("rparen", ")"), ("variable_end", "}}")):
                    yield Token(token.lineno, kind, value)


class _NoBudget(Exception):
    """A filter was called outside a render (see :func:`_limited_filter`)."""


_SIZE_ESTIMATES: dict[str, Callable[..., int]] = {
    # filter name -> (value, *args) -> an upper bound of the result's size, for the filters
    # whose result can be much larger than their input
    "join": lambda value, d="", *a, **k: (
        sum(len(str(x)) for x in value) + len(str(d)) * len(value)
        if isinstance(value, (list, tuple, str)) else 0),
    "replace": lambda value, old="", new="", *a, **k: (
        len(value) + (value.count(old) if old else len(value) + 1) * len(str(new))
        if isinstance(value, str) and isinstance(old, str) else 0),
    "wordwrap": lambda value, width=79, break_long_words=True, wrapstring=None, *a, **k: (
        len(value) * (1 + len(wrapstring or "\n")) if isinstance(value, str) else 0),
    "indent": lambda value, width=4, *a, **k: (
        (len(value) + 1) * (1 + (width if isinstance(width, int) else len(str(width))))
        if isinstance(value, str) else 0),
    "center": lambda value, width=80, *a, **k: max(len(str(value)), int(width)),
    "batch": lambda value, linecount, *a, **k: len(value) + int(linecount)
    if isinstance(value, SequenceABC) else int(linecount),
    "slice": lambda value, slices, *a, **k: int(slices),
}


def _limited_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a jinja filter) with the running render's size checks around it."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    estimate = _SIZE_ESTIMATES.get(name)

    @functools.wraps(func)  # keeps jinja_pass_arg: jinja still passes the context first
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            # Not inside a render: jinja is folding a constant expression while compiling
            # ("{{ 'a'|center(10**9) }}"). Refusing makes it compile a runtime call instead,
            # which then runs under the render's budget.
            raise _NoBudget(name)
        if len(args) <= skip:
            return func(*args, **kwargs)
        budget.tick()
        value, rest = args[skip], args[skip + 1:]
        budget.check_int_args(rest, kwargs)
        if name == "format" and isinstance(value, str):  # jinja's format filter is "%"
            budget.check_percent_format(value, rest)
        if estimate is not None:
            try:
                size = estimate(value, *rest, **kwargs)
            except (TypeError, ValueError):
                size = 0  # the filter itself reports a bad call
            budget.check_size(size, f"a '{name}' result")
        result = func(*args, **kwargs)
        budget.check_value(result)
        return result

    return wrapper


class _TickingRange(SequenceABC):
    """``range()`` for templates: at most :data:`MAX_RANGE` items, and iterating it counts
    against the render's deadline (a ``range`` loop is the usual runaway)."""

    def __init__(self, *args: int) -> None:
        self._range = range(*args)
        if len(self._range) > MAX_RANGE:
            raise TemplateLimitError(
                f"range() in a chat template may produce at most {MAX_RANGE} items, "
                f"got {len(self._range)}")

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __iter__(self) -> Iterator[int]:
        for i in self._range:
            budget = _budget()
            if budget is not None:
                budget.tick()
            yield i

    def __repr__(self) -> str:
        return repr(self._range)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if not (isinstance(n, int) and 0 <= n <= 100 and isinstance(max, int) and max <= 1000):
        raise TemplateLimitError("lipsum() in a chat template takes n <= 100 and max <= 1000")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus the running render's budget on every call and size-multiplying
    operator."""

    # Not "+": like "~" it only adds sizes, and doubling needs a loop-carried namespace value
    # or a recursive macro, both checked (namespace assignment, call arguments). Intercepting
    # it would cost every "'<|im_start|>' + role" a Python call.
    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is not None:
            budget.tick()
            budget.check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        if __obj is _render_tick and budget is not None:  # the loop tick: the hot path
            budget.check_time()
            return ""
        if budget is not None:
            budget.check_time()  # a call can be a recursive macro: read the clock every time
            budget.check_int_args(args, kwargs)
            for value in (*args, *kwargs.values()):  # a macro doubling its argument each call
                budget.check_value(value)
            target = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format
            if getattr(target, "__name__", "") in ("format", "format_map") and \
                    isinstance(getattr(target, "__self__", None), str):
                budget.check_str_format(target.__self__)
            if getattr(target, "__name__", "") == "join" and \
                    isinstance(getattr(target, "__self__", None), str) and args and \
                    isinstance(args[0], (list, tuple)):
                budget.check_size(len(target.__self__) * len(args[0]), "a joined value")
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.check_value(result)
        return result


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses the tag
    to mark assistant tokens for training masks; serving only needs the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        budget = _budget()
        if budget is not None:  # "{% set ns.s = ns.s ~ ns.s %}" in a loop doubles each time
            budget.check_value(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON (as transformers gives them).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedEnvironment(
        # No optimizer: it folds constant expressions while compiling, outside any render
        # budget ("{{ 'a'|center(10**9) }}" would run, unbounded, inside compile_template).
        optimized=False,
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols, _LoopTick],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _TickingRange
    env.globals["lipsum"] = _lipsum
    env.globals[_TICK_NAME] = _render_tick
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template; a syntax error becomes :class:`ChatTemplateError`."""
    try:
        template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e
    except (RecursionError, SyntaxError, MemoryError, ValueError) as e:
        # Deep nesting ("((((...", a hundred nested blocks) overflows jinja's parser or
        # Python's compiler: the template's fault, not the server's.
        raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}: "
                                f"{e}") from None
    # Jinja keeps a template's globals as a ChainMap over the environment's, and every render
    # flattens it into the new context: ~5 µs of a ~14 µs render. Our environment's globals
    # are fixed once built, so a plain dict snapshot renders the same, faster.
    template.globals = dict(template.globals)
    return template


def _iter_nodes(node: jinja2.nodes.Node) -> Iterator[jinja2.nodes.Node]:
    yield node
    for child in node.iter_child_nodes():
        yield from _iter_nodes(child)


def _is_content_ref(node: jinja2.nodes.Node) -> bool:
    """``x['content']``, ``x.content`` or a bare ``content`` variable, possibly filtered."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name == "content"


@lru_cache(maxsize=16)
def detect_content_format(source: str) -> ContentFormat:
    """"openai" if the template loops over a message's content (it understands parts)."""
    try:
        tree = _environment().parse(source)
    except (jinja2.exceptions.TemplateSyntaxError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    for node in _iter_nodes(tree):
        if isinstance(node, jinja2.nodes.For) and _is_content_ref(node.iter):
            return "openai"
    return "string"


@lru_cache(maxsize=16)
def template_uses_tools(source: str) -> bool:
    """Whether the template reads a ``tools`` variable (else a model fed by it never sees the
    tools a request offers)."""
    try:
        tree = _environment().parse(source)
    except (jinja2.exceptions.TemplateSyntaxError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None
    return any(isinstance(node, jinja2.nodes.Name) and node.name == "tools"
               for node in _iter_nodes(tree))


def _template_tool_calls(i: int, tool_calls: Any) -> list[Any]:
    """An assistant message's ``tool_calls`` for the template: each call's ``arguments`` JSON
    string parsed to a dict, as vLLM passes them (transformers' convention: Llama 3.x's and
    Mistral's templates write ``arguments | tojson``; Qwen's take either form)."""
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a list of tool calls")
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"messages[{i}].tool_calls[{j}] must be an object with a "
                                    f"'function' holding a 'name' and 'arguments'")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
                raise ChatTemplateError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                    f"{e if isinstance(e, ValueError) else 'nested too deeply'}") from None
        elif arguments is None:
            arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def normalize_messages(messages: Sequence[Mapping[str, Any]],
                       content_format: ContentFormat) -> list[dict[str, Any]]:
    """Plain dicts for the template: None-valued keys dropped (as transformers does, templates
    render a literal "None" otherwise) and content parts flattened for "string" templates.
    A null ``content`` (an assistant turn that only calls tools) becomes "" (or no parts), as
    vLLM renders it; tool calls' arguments are parsed (:func:`_template_tool_calls`)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" not in msg:
            msg["content"] = "" if content_format == "string" else []
        if "tool_calls" in msg:
            msg["tool_calls"] = _template_tool_calls(i, msg["tool_calls"])
        content = msg.get("content")
        if isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: only text parts are supported "
                        f"(type 'text' with a string 'text'), got type {kind!r}")
                texts.append(part["text"])
            if content_format == "string":
                msg["content"] = "\n".join(texts)
            else:
                msg["content"] = [{"type": "text", "text": t} for t in texts]
        out.append(msg)
    return out


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: Mapping[str, Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> str:
    """Render ``messages`` the way ``tokenizer.apply_chat_template(..., tokenize=False)`` does.

    ``special_tokens`` (bos_token, eos_token, ...) and ``chat_template_kwargs`` become template
    variables; the latter may not override ``messages`` or the other named arguments. The
    render runs under ``limits`` (default :class:`RenderLimits`); it blocks the calling thread,
    so servers call it from a worker thread.
    """
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true")
    template = compile_template(source)
    chat = normalize_messages(messages, detect_content_format(source))
    final_text: str | None = None
    if continue_final_message:
        if not chat:
            raise ChatTemplateError("continue_final_message is set but there are no messages")
        final = chat[-1].get("content")
        if isinstance(final, str):
            final_text = final
            chat[-1]["content"] = final + _CONTINUE_TAG
        elif isinstance(final, list) and final:
            final_text = final[-1]["text"]
            final[-1]["text"] = final_text + _CONTINUE_TAG
        else:
            raise ChatTemplateError(
                "continue_final_message is set but the final message has no text to continue")
    reserved = {"messages", "tools", "documents", "add_generation_prompt"}
    extra = dict(chat_template_kwargs or {})
    clash = sorted(reserved & set(extra))
    if clash:
        raise ChatTemplateError(
            f"chat_template_kwargs cannot set {', '.join(clash)}; use the request fields")
    variables = {**(special_tokens or {}), **extra}
    rendered = _render(template, limits or RenderLimits(), messages=chat, tools=tools,
                       documents=documents, add_generation_prompt=add_generation_prompt,
                       **variables)
    if final_text is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message is set but the chat template drops the final message")
        loc = rendered.rindex(tag)
        if rendered[loc: loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:loc]
        else:  # the template trimmed the trailing space after the tag
            rendered = rendered[:loc].rstrip()
    return rendered


def _render(template: jinja2.Template, limits: RenderLimits, **variables: Any) -> str:
    """``template.render(**variables)`` under ``limits``; every failure is a
    :class:`ChatTemplateError`."""
    budget = _Budget(limits)
    previous_budget = _budget()
    _current.budget = budget
    parts: list[str] = []
    size, max_chars = 0, limits.max_chars
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > max_chars:
                raise RenderedTooLongError(size, max_chars)
            parts.append(chunk)
        budget.check_time()
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:  # includes raise_exception() and SecurityError
        raise ChatTemplateError(f"chat template error: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template error: too deeply nested (recursion)") from None
    except MemoryError:
        raise TemplateLimitError("chat template error: out of memory while rendering") from None
    except Exception as e:  # a template can raise anything (OverflowError, ZeroDivisionError...)
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    finally:
        _current.budget = previous_budget
    return "".join(parts)
