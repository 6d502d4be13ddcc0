"""What a patch changes, and the handle that undoes it (``tigon.Patch``).

A plan is a list of changes, each with ``apply`` and ``undo``: setting an attribute on an instance or a
class (:class:`SetAttr`), or putting one module in the places of another (:class:`SwapModule`).
:func:`apply_plan` applies them in order, undoing what it applied if one fails, logs each replaced part
once, and returns the :class:`Patch` whose ``revert()`` undoes them, last first.

What others install after the patch stays. An attribute tigon set that something else replaced since (a
forward that TRL's ``add_fused_lm_head`` or accelerate's hooks put on the model, a module that a wrapper put in
the place of tigon's) is left as it is, unless the newcomer still calls what tigon put there (it wraps tigon's
forward: it keeps it in a closure, a ``functools.partial``, ``__wrapped__``): that cannot be restored without
breaking the newcomer, so ``revert()`` raises ValueError naming it, before it undoes anything. Hooks registered
on a module that tigon swapped are registered on the module it replaced as well (the two share their hook
dicts), so they outlive ``revert()``.
"""

from __future__ import annotations

import functools
import logging
import types
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

logger = logging.getLogger("tigon.patching")

_MISSING = object()
# How deep :func:`_reaches` looks into wrappers (a wrapper of a wrapper of ... tigon's forward).
SEARCH_DEPTH = 8


def _reaches(obj, target, depth: int = SEARCH_DEPTH, seen=None) -> bool:
    """Whether calling ``obj`` may call ``target``: ``obj`` is it, or holds it as the function a wrapper calls
    (a bound method's function, a partial's function and arguments, a closure's cells, ``__wrapped__``, the
    attributes of a callable object, and the items of the containers among them). Modules are not searched:
    a wrapper's module is the model itself, which holds everything."""
    if obj is target:
        return True
    seen = set() if seen is None else seen
    if (depth == 0 or obj is None or id(obj) in seen
            or isinstance(obj, (nn.Module, type, str, bytes, int, float, bool, types.ModuleType))):
        return False
    seen.add(id(obj))
    inner = []
    if isinstance(obj, types.MethodType):
        inner.append(obj.__func__)
    elif isinstance(obj, functools.partial):
        inner += [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        inner += obj
    elif isinstance(obj, dict):
        inner += obj.values()
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    if not isinstance(obj, (types.FunctionType, types.MethodType, tuple, list, set, frozenset, dict)):
        inner += getattr(obj, "__dict__", {}).values()
    elif isinstance(obj, types.FunctionType):
        inner.append(obj.__dict__.get("__wrapped__"))
    return any(_reaches(item, target, depth - 1, seen) for item in inner)


def _describe(obj) -> str:
    """A short name for what replaced tigon's attribute: where its code is (``functools.wraps`` copies the
    wrapped function's names onto a wrapper, its code keeps its own)."""
    if isinstance(obj, functools.partial):
        return f"functools.partial({_describe(obj.func)}, ...)"
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is not None:
        return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"
    return f"a {type(obj).__qualname__}"


class SetAttr:
    """Set ``obj.name`` (an instance or a class attribute); undo restores it or deletes it again, if the
    attribute still holds what the patch set (see the module docs)."""

    def __init__(self, obj, name, value):
        self.obj, self.name, self.value = obj, name, value

    def apply(self):
        own = vars(self.obj)
        self.had, self.old = self.name in own, own.get(self.name)
        setattr(self.obj, self.name, self.value)

    def _where(self) -> str:
        obj = self.obj
        return f"{obj.__name__ if isinstance(obj, type) else type(obj).__name__}.{self.name}"

    def blocked(self, state: dict) -> str | None:
        """Why ``undo`` cannot run (None: it can), with ``state`` the attributes as the undos of the changes
        after this one (in ``revert``'s order) will leave them; records what this undo will leave."""
        key = (id(self.obj), self.name)
        current = state.get(key, vars(self.obj).get(self.name, _MISSING))
        if current is self.value:
            state[key] = self.old if self.had else _MISSING
            return None
        if current is not _MISSING and _reaches(current, self.value):
            return (f"{self._where()} was replaced after the patch by {_describe(current)}, which calls what tigon "
                    "set there (it wraps tigon's: TRL's add_fused_lm_head, accelerate's hooks do)")
        return None

    def undo(self):
        if vars(self.obj).get(self.name, _MISSING) is not self.value:
            return  # replaced since by something that does not call tigon's: it stays
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            delattr(self.obj, self.name)


# nn.Module's hook dicts: a swapped-in module shares the ones of the module it replaces.
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class SwapModule:
    """Put ``new`` wherever ``old`` sits in the tree (every (parent, name) site).

    ``new`` also gets the plain attributes of ``old`` that it lacks (an MLP's ``config``), the same
    objects: code that reads a replaced module's attributes keeps working; and ``old``'s hook dicts, the same
    dicts: a hook registered on either module, before the patch or after it, runs on the one in the tree.
    """

    def __init__(self, old, new, sites):
        self.old, self.new, self.sites = old, new, sites
        for name, value in vars(old).items():
            if not name.startswith("_") and name != "training" and not hasattr(new, name):
                setattr(new, name, value)
        for name in HOOK_DICTS:
            if isinstance(vars(old).get(name), dict):
                vars(new)[name] = vars(old)[name]

    def apply(self):
        for parent, name in self.sites:
            setattr(parent, name, self.new)

    def blocked(self, state: dict) -> str | None:
        """Why ``undo`` cannot run: a module put in tigon's place holds tigon's (a wrapper module)."""
        for parent, name in self.sites:
            current = parent._modules.get(name)
            if current is not self.new and isinstance(current, nn.Module) and any(
                    m is self.new for m in current.modules()):
                return (f"{type(parent).__name__}.{name} was replaced after the patch by a "
                        f"{type(current).__name__} that holds tigon's {type(self.new).__name__}")
        return None

    def undo(self):
        # Hand back what the replacement holds now: the same Parameter objects unless something
        # (a checkpoint load with assign=True, a .to() that swaps tensors) replaced them meanwhile.
        for name in list(self.old._parameters):
            if name in self.new._parameters:
                self.old._parameters[name] = self.new._parameters[name]
        for name in list(self.old._modules):
            if name in self.new._modules:
                self.old._modules[name] = self.new._modules[name]
        self.old.train(self.new.training)
        for parent, name in self.sites:
            if parent._modules.get(name) is self.new:  # a module put there since (not holding tigon's) stays
                setattr(parent, name, self.old)


@dataclass
class Plan:
    """Changes to apply, and the readable line (with a count) each one is reported under."""

    changes: list = field(default_factory=list)
    counts: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, change, line=None):
        """Queue ``change``; ``line`` is what the patch report counts it under (None: not reported)."""
        self.changes.append(change)
        if line is not None:
            self.counts[line] += 1

    def note(self, line):
        """Count ``line`` once more, for a change queued under another line that also does this."""
        self.counts[line] += 1

    def lines(self):
        return [line if n == 1 else f"{line} ({n} modules)" for line, n in self.counts.items()]


class Patch:
    """What one ``tigon.patch`` call changed; ``revert()`` restores exactly what was there before."""

    def __init__(self, target: str, changes, replaced: list[str]):
        self.target = target
        self._changes = list(changes)
        self.replaced = list(replaced)

    @property
    def active(self) -> bool:
        return bool(self._changes)

    def revert(self) -> None:
        """Undo every change, last first, leaving what others installed since (module docs). Where something
        installed since wraps what tigon set, raises ValueError and changes nothing. Reverting twice is a
        no-op."""
        state: dict = {}
        blocked = [why for change in reversed(self._changes)
                   if (why := getattr(change, "blocked", lambda state: None)(state)) is not None]
        if blocked:
            raise ValueError(
                f"tigon: cannot revert the patch of {self.target}: {'; '.join(blocked)}. Remove what was "
                "installed after the patch first (or revert the later patch); nothing was reverted"
            )
        for change in reversed(self._changes):
            change.undo()
        if self._changes:
            logger.info("tigon: reverted the patch of %s", self.target)
        self._changes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()

    def __repr__(self):
        state = "active" if self.active else "reverted or empty"
        body = "".join(f"\n  {line}" for line in self.replaced)
        return f"Patch({self.target}, {state}){body}"


def apply_plan(plan: Plan, target: str, log_level: int) -> Patch:
    applied = []
    try:
        for change in plan.changes:
            change.apply()
            applied.append(change)
    except BaseException:
        for change in reversed(applied):
            change.undo()
        raise
    replaced = plan.lines()
    for line in replaced:
        logger.log(log_level, "tigon: %s: %s", target, line)
    return Patch(target, applied, replaced)
