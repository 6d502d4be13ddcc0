"""Seeing through decorators: the function a transformers method really runs, and copies of it.

transformers wraps more and more of its methods in decorators: ``@deprecate_kwarg`` (5.24 renames
``past_key_values`` to ``cache`` that way), ``@can_return_tuple``, and the checkpointing wrapper that
``GradientCheckpointingLayer`` puts around every decoder layer's ``forward`` (5.23 on). Each is a
closure made by ``functools.wraps``: it records the function it wraps in ``__wrapped__`` and calls it
through a closure cell. tigon needs two things from such a chain:

- **the body**: the innermost function, whose code and globals say what the method does (does the
  attention forward call the module-level ``apply_rotary_pos_emb``? is the decoder layer's forward
  the one tigon fuses?). :func:`wrapper_chain` follows ``__wrapped__`` and refuses a wrapper that
  does not hold the function it names: such a wrapper may run another body than the one it shows
  (``functools.wraps`` only copies names), and checking the shown body would prove nothing.
- **the same chain around another body**: :func:`rewrapped` copies every wrapper with the cell that
  held the next function pointing at the replacement, so the replacement runs under exactly the
  decorators of the installed version (the kwarg renaming, the tuple conversion), whatever they are.

:func:`named_parameters` and :func:`bind` let a replacement take its arguments as the body's signature
says, whatever the release calls them (``cache`` or ``past_key_values``). :func:`with_globals` is the
rope patch's tool: a copy of a method's body that sees other functions
in place of its module's globals, rewrapped as the original was.
"""

from __future__ import annotations

import inspect
import sys
import types


class WrapperMismatch(ValueError):
    """A decorator's wrapper that does not call the function its ``__wrapped__`` names."""


def _holds(wrapper: types.FunctionType, inner) -> bool:
    for cell in wrapper.__closure__ or ():
        try:
            if cell.cell_contents is inner:
                return True
        except ValueError:  # an empty cell
            continue
    return False


def wrapper_chain(fn) -> list:
    """``[fn, fn.__wrapped__, ...]`` down to the body; each wrapper must hold the next in a closure cell.

    Raises :class:`WrapperMismatch` (a ValueError) naming the wrapper otherwise.
    """
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__"):
        outer, inner = chain[-1], chain[-1].__wrapped__
        if not isinstance(outer, types.FunctionType) or not _holds(outer, inner):
            raise WrapperMismatch(
                f"{getattr(outer, '__qualname__', outer)!s} claims to wrap {getattr(inner, '__qualname__', inner)!s} "
                "but does not call it: the body it runs cannot be checked"
            )
        chain.append(inner)
    return chain


def body(fn):
    """The innermost function of ``fn``'s decorator chain (see :func:`wrapper_chain`)."""
    return wrapper_chain(fn)[-1]


def _copy_function(fn, globals_=None, closure=None):
    copy = types.FunctionType(
        fn.__code__, fn.__globals__ if globals_ is None else globals_, fn.__name__, fn.__defaults__,
        fn.__closure__ if closure is None else closure,
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__dict__.update(fn.__dict__)
    return copy


def rewrapped(fn, new_body, *, skip_outer: int = 0):
    """``fn``'s decorator chain around ``new_body`` instead of ``fn``'s body.

    Every wrapper is copied with the closure cell that held the next function of the chain now holding
    the copy below it (``__wrapped__`` follows). ``skip_outer`` leaves out that many outermost wrappers
    (the decoder layer's checkpointing wrapper, which tigon's layer forward honours itself).
    """
    chain = wrapper_chain(fn)[skip_outer:]
    current = new_body
    for wrapper, old_next in zip(reversed(chain[:-1]), reversed(chain[1:]), strict=True):
        cells = []
        for cell in wrapper.__closure__:
            try:
                held = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            cells.append(types.CellType(current) if held is old_next else cell)
        copy = _copy_function(wrapper, closure=tuple(cells))
        copy.__wrapped__ = current
        current = copy
    return current


def bind(positional, defaults, args, kwargs) -> dict:
    """Every named argument of a call, given or defaulted, and the extra keywords: what
    ``inspect.Signature.bind`` + ``apply_defaults`` give, at the cost of two dict merges."""
    if args:
        if len(args) > len(positional):
            raise TypeError(
                f"forward() takes {len(positional) + 1} positional arguments after self, got {len(args) + 1}"
            )
        given = dict(zip(positional, args, strict=False))
        twice = given.keys() & kwargs.keys()
        if twice:
            raise TypeError(f"forward() got multiple values for argument {sorted(twice)[0]!r}")
        return {**defaults, **given, **kwargs}
    return {**defaults, **kwargs}


def named_parameters(forward, skip: int):
    """``forward``'s positional-or-keyword parameter names after the first ``skip``, and the defaults of
    its named parameters."""
    params = list(inspect.signature(forward).parameters.values())[skip:]
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD)
    return positional, {p.name: p.default for p in named if p.default is not p.empty}


def calls_global(fn, name: str) -> bool:
    """Whether ``fn``'s body reads the module-level ``name`` (and its module has one)."""
    inner = body(fn)
    return name in inner.__code__.co_names and name in inner.__globals__


def with_globals(fn, **names):
    """A copy of ``fn`` whose body sees ``names`` in place of its module's globals of those names.

    The body's copy gets the globals of a module of tigon's own, ``tigon._patched.<module>``: a copy of
    the body's module namespace with the names replaced, registered in ``sys.modules``; the decorators
    around it are copied as they are (:func:`rewrapped`). The original module, and every other
    function reading its globals, are untouched. A real module (rather than a bare dict) matters under
    torch.compile: Dynamo guards a global by looking the name up on the module that ``__name__`` names,
    so the namespace must be a module where the name resolves to the function the copy actually calls.
    """
    inner = body(fn)
    source = sys.modules[inner.__globals__["__name__"]]
    key = "tigon._patched." + source.__name__
    namespace = sys.modules.get(key)
    held = {} if namespace is None else namespace.__dict__
    if namespace is not None and all(held.get(n) in (v, inner.__globals__.get(n)) for n, v in names.items()):
        # One namespace per module, every copy's replacements in it (the text and the vision attention
        # of a Qwen-VL module replace different functions): the names a copy does not call are unused there.
        namespace.__dict__.update(names)
    if namespace is None or any(namespace.__dict__.get(n) is not v for n, v in names.items()):
        namespace = types.ModuleType(key)
        namespace.__dict__.update(inner.__globals__)
        namespace.__dict__.update(names)
        namespace.__name__ = key
        sys.modules[key] = namespace
    copy = _copy_function(inner, globals_=namespace.__dict__)
    copy.__module__ = key
    copy._tigon = True
    outer = rewrapped(fn, copy)
    outer._tigon = True
    return outer
