"""A Jinja sandbox for chat templates sent in requests: code from the client, rendered with
limits on time, on the size of what it computes, and on its output.

The environment is transformers' (an ``ImmutableSandboxedEnvironment`` with its filters and
globals, see :mod:`.chat_template`), plus checks before every operation that can make a value
much larger than its operands: the binary operators ``+ * ** %``, string concatenation ``~``,
method and global calls, filters, and each ``{{ }}`` output. A check estimates the result's
size first, so that ``('x' * 1200000000)|length`` stops before it allocates. A render also
stops past :data:`MAX_SECONDS` (a trace function in the rendering thread checks the deadline
on every line of Python run, compilation and the checks included) and past
:data:`MAX_OUTPUT_CHARS` of output. Any limit raises :class:`TemplateLimit`.

What this cannot bound is one C-level call that is slow or large on operands within the
limits; the checks close the known amplifiers (repetition, padding widths, joins of repeated
items, string conversion of containers that share one large item). A request template is
refused unless the operator trusts the clients (``--trust_request_chat_template``).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_SECONDS = 1.0
"""Wall time for compiling and rendering one request's template."""
MAX_CHARS = 8 * 2**20
"""Characters in any one string a template makes, and in its whole output."""
MAX_OUTPUT_CHARS = MAX_CHARS
MAX_ITEMS = 2**20
"""Items in any one list or tuple a template makes; also the largest integer argument."""
MAX_INT_BITS = 2**16
MAX_ALLOCATED = 64 * 2**20
"""Estimated bytes that one render's checked operations may produce in all."""
MAX_SOURCE_CHARS = 256 * 2**10
"""Length of a request's template (the largest on the Hub are a few tens of KiB)."""

_WIDTHS = re.compile(r"\d+")


class TemplateLimit(BaseException):
    """A limit reached while compiling or rendering a request's template.

    A ``BaseException`` so that no ``except Exception`` between the check and the render's
    caller (in jinja or in the code it calls) swallows it.
    """


@dataclass
class _Render:
    deadline: float
    allocated: int = 0


_current = threading.local()


def _render() -> _Render:
    render: _Render | None = getattr(_current, "render", None)
    if render is None:  # only ever used inside limited_render
        raise TemplateLimit("a request template rendered outside its limits")
    return render


@contextmanager
def limited_render(seconds: float = MAX_SECONDS) -> Iterator[None]:
    """Compile and render inside: past ``seconds`` the Python code running in this thread
    raises :class:`TemplateLimit`; the size checks charge this render's allocation budget."""
    render = _Render(time.monotonic() + seconds)

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > render.deadline:
            raise TemplateLimit(f"the chat template ran longer than its limit of {seconds:g} s")
        return trace

    previous = sys.gettrace()
    _current.render = render
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
        _current.render = None


def _check(chars: int = 0, items: int = 0, bits: int = 0) -> None:
    """Refuse a value of this size before it is made."""
    if chars > MAX_CHARS:
        raise TemplateLimit(
            f"the chat template would make a string of {chars} characters (limit {MAX_CHARS})"
        )
    if items > MAX_ITEMS:
        raise TemplateLimit(
            f"the chat template would make a list of {items} items (limit {MAX_ITEMS})"
        )
    if bits > MAX_INT_BITS:
        raise TemplateLimit(
            f"the chat template would make a {bits}-bit integer (limit {MAX_INT_BITS} bits)"
        )
    render = _render()
    if render.allocated + chars + 8 * items + bits // 8 > MAX_ALLOCATED:
        raise TemplateLimit(
            f"the chat template allocates more than its limit of {MAX_ALLOCATED} bytes"
        )


def _charged(value: Any) -> Any:
    """``value``, counted against the render's budget (refused if over a limit)."""
    chars = len(value) if isinstance(value, str | bytes) else 0
    items = len(value) if isinstance(value, list | tuple | dict | set | frozenset) else 0
    bits = value.bit_length() if type(value) is int else 0
    _check(chars, items, bits)
    _render().allocated += chars + 8 * items + bits // 8
    return value


def text_size(value: Any, limit: int = MAX_CHARS) -> int:
    """About ``len(str(value))`` (an upper estimate), counted no further than past ``limit``:
    a container that holds one large string many times is as large as its ``str``.
    Breadth first, so that a container's length counts before its items are looked at."""
    if isinstance(value, str):
        return len(value)
    total, queue = 0, deque([value])
    while queue and total <= limit:
        item = queue.popleft()
        if isinstance(item, str | bytes):
            total += len(item) + 2
        elif type(item) is int:
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Namespace):
            total += 16
            queue.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            if total <= limit:
                queue.extend(item.keys())
                queue.extend(item.values())
        elif isinstance(item, Collection) and not isinstance(item, range):
            total += 2 + 2 * len(item)
            if total <= limit:
                queue.extend(item)
        else:
            total += 32
    return total


def _check_ints(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Integer arguments are widths and counts: none larger than the largest list."""
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > MAX_ITEMS:
            raise TemplateLimit(
                f"the chat template passes {value} to a function (limit {MAX_ITEMS})"
            )


def _format_chars(template: str, values: Any) -> int:
    """Characters that ``template % values`` or ``template.format(...)`` can make: widths
    written in the template, and integers among the values (``%*s``, ``{:{w}}``)."""
    widths = _WIDTHS.findall(template)
    if any(len(width) > 9 for width in widths):
        return MAX_CHARS + 1
    chars = len(template) + sum(map(int, widths)) + text_size(values)
    if "*" in template or "{" in template:
        chars += _integers(values)
    return chars


def _integers(values: Any) -> int:
    """The sum of the integers in ``values`` and the tuples and dicts it holds."""
    if type(values) is int:
        return abs(values)
    if isinstance(values, dict):
        values = tuple(values.values())
    return sum(map(_integers, values)) if isinstance(values, tuple) else 0


def _check_length(sequence: Any, length: int) -> None:
    if isinstance(sequence, str | bytes):
        _check(chars=length)
    else:
        _check(items=length)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` if its result would be over a limit."""
    sized = str | bytes | list | tuple
    if operator == "*" and type(left) is int and type(right) is int:
        _check(bits=left.bit_length() + right.bit_length())
    elif operator == "*" and isinstance(left, sized) and type(right) is int:
        _check_length(left, len(left) * max(right, 0))
    elif operator == "*" and type(left) is int and isinstance(right, sized):
        _check_length(right, len(right) * max(left, 0))
    elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1:
        _check(bits=left.bit_length() * max(right, 0))
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        _check_length(left, len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check(_format_chars(left, right))


def _check_str_method(
    owner: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Refuse a ``str`` method call whose result would be over a limit; ``join``'s argument is
    made a list first (it may be a generator, read once)."""
    if name == "join" and len(args) == 1:
        items = list(args[0])
        _check(items=len(items))
        parts = sum(len(item) if isinstance(item, str) else 0 for item in items)
        _check(parts + len(owner) * max(len(items) - 1, 0))
        return (items,)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        grows = len(args[1]) - len(args[0]) if isinstance(args[1], str) else 0
        _check(len(owner) + owner.count(args[0]) * max(grows, 0))
    elif name == "expandtabs" and args and type(args[0]) is int:
        _check(len(owner) + owner.count("\t") * max(args[0], 0))
    elif name in ("format", "format_map"):
        _check(_format_chars(owner, (args, kwargs)))
    elif name == "translate":
        _check(len(owner) * text_size(args))
    return args


def _str_method(function: Any) -> tuple[str, str] | None:
    """(the string, the method's name) for a bound ``str`` method (or the sandbox's wrapper
    of ``str.format``), else None."""
    method = getattr(function, "__wrapped__", function)
    owner = getattr(method, "__self__", None)
    if isinstance(owner, str):
        return owner, getattr(method, "__name__", "")
    return None


# --- filters ------------------------------------------------------------------------------

SHALLOW_FILTERS = frozenset(
    "abs attr batch count d default dictsort first float groupby int items last length list "
    "map max min random reject rejectattr reverse round safe select selectattr slice sort "
    "unique".split()
)
"""Filters that never turn their whole input into one string."""


def _filter_chars(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Characters a filter that makes a string can make from ``value`` (upper estimate)."""

    def arg(index: int, key: str, default: Any) -> Any:
        return args[index] if len(args) > index else kwargs.get(key, default)

    size = text_size(value)
    if name == "join":
        count = len(value) if isinstance(value, Collection) else size
        return size + text_size(arg(0, "d", "")) * count
    if name == "indent":
        width = arg(0, "width", 4)
        lines = value.count("\n") + 1 if isinstance(value, str) else size
        return size + lines * (width if type(width) is int else text_size(width))
    if name == "replace" and isinstance(value, str):
        old, new = str(arg(0, "old", "")), str(arg(1, "new", ""))
        return size + value.count(old) * max(len(new) - len(old), 0)
    if name == "format" and isinstance(value, str):
        return _format_chars(value, (args, kwargs))
    if name == "tojson":
        indent = arg(1, "indent", None)
        width = indent if type(indent) is int else text_size(indent or "")
        escaped = 6 if arg(0, "ensure_ascii", False) else 1
        return size * escaped * (1 + width) + size * text_size(arg(2, "separators", None))
    if name == "wordwrap":
        return size * (1 + text_size(arg(2, "wrapstring", None) or ""))
    if name in ("escape", "e", "forceescape", "urlencode", "urlize", "pprint"):
        return 6 * size
    return size + text_size((args, kwargs))


def limited_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its arguments and its result checked (jinja's pass-context marker
    kept, so that jinja still passes what the filter expects first)."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
    shallow = name in SHALLOW_FILTERS

    @wraps(function)
    def limited(*args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs)
        if name == "join" and len(args) > skip:  # a generator is read once, here
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
        if not shallow and len(args) > skip:
            _check(_filter_chars(name, args[skip], args[skip + 1 :], kwargs))
        return _charged(function(*args, **kwargs))

    return limited


# --- the environment ----------------------------------------------------------------------


class LimitedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a checked join (jinja writes ``str_join((a, b))``)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with every growing operation checked (see the module)."""

    code_generator_class = LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options: Any):
        super().__init__(finalize=self.checked_output, **options)

    def limit_filters(self) -> None:
        """Wrap every filter (call after adding the environment's own)."""
        for name, function in list(self.filters.items()):
            self.filters[name] = limited_filter(name, function)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _charged(super().call_binop(context, operator, left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs)
        method = _str_method(obj)
        if method is not None:
            args = _check_str_method(*method, args, kwargs)
        return _charged(super().call(context, obj, *args, **kwargs))

    @staticmethod
    def checked_concat(parts: tuple[Any, ...]) -> str:
        _check(sum(text_size(part) for part in parts))
        return _charged("".join(map(str, parts)))

    @staticmethod
    def checked_output(value: Any) -> Any:
        _check(text_size(value))
        return value


def render_limited(template: Any, context: dict[str, Any]) -> str:
    """Render a template of a :class:`LimitedSandbox` (inside :func:`limited_render`),
    streaming its output and stopping past :data:`MAX_OUTPUT_CHARS`."""
    pieces, size = [], 0
    for piece in template.generate(context):
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise TemplateLimit(
                f"the chat template's output is over its limit of {MAX_OUTPUT_CHARS} characters"
            )
        pieces.append(piece)
    return "".join(pieces)
