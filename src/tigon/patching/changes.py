"""What a patch changes, and the handle that undoes it.

A plan is a list of changes, each with ``apply`` and ``undo``: setting an attribute on an instance or a
class (:class:`_SetAttr`), or putting one module in the places of another (:class:`_SwapModule`).
:func:`_apply` applies them in order, undoing what it applied if one fails, logs each replaced part
once, and returns the :class:`Patch` whose ``revert()`` undoes them, last first.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

logger = logging.getLogger("tigon.patching")


class _SetAttr:
    """Set ``obj.name`` (an instance or a class attribute); undo restores it or deletes it again."""

    def __init__(self, obj, name, value):
        self.obj, self.name, self.value = obj, name, value

    def apply(self):
        own = vars(self.obj)
        self.had, self.old = self.name in own, own.get(self.name)
        setattr(self.obj, self.name, self.value)

    def undo(self):
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            delattr(self.obj, self.name)


class _SwapModule:
    """Put ``new`` wherever ``old`` sits in the tree (every (parent, name) site).

    ``new`` also gets the plain attributes of ``old`` that it lacks (an MLP's ``config``), the same
    objects: code that reads a replaced module's attributes keeps working.
    """

    def __init__(self, old, new, sites):
        self.old, self.new, self.sites = old, new, sites
        for name, value in vars(old).items():
            if not name.startswith("_") and name != "training" and not hasattr(new, name):
                setattr(new, name, value)

    def apply(self):
        for parent, name in self.sites:
            setattr(parent, name, self.new)

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
            setattr(parent, name, self.old)


@dataclass
class _Plan:
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
        """Undo every change, last first. Reverting twice is a no-op."""
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


def _apply(plan: _Plan, target: str, log_level: int) -> Patch:
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
