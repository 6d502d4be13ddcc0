"""``merge_and_unload()`` / ``unload()`` of a patched ``peft.PeftModel`` give back a plain transformers model.

PEFT's unloading replaces each LoRA layer by its base layer (merged, for ``merge_and_unload``) and returns
the base model, which still holds what ``tigon.patch`` installed (its modules, its instance forwards).
Patching a ``PeftModel`` sets, on that instance, an ``unload`` and a ``merge_and_unload`` that call PEFT's
and then revert the patch: the model they return is transformers' own, its weights PEFT's merged ones,
reverting leaves what PEFT installed since in place (patch_handle.py). Both are the patch's changes, so
``Patch.revert()`` removes them. A model patched before ``get_peft_model`` wrapped it cannot be told
from PEFT's side: there, ``patch.revert()`` after merging makes the model plain.

The patch is reached through a :class:`PatchOf` on the instance. A copy of the model (``copy.deepcopy``,
pickling) holds an empty one, since the patch's changes name the original's modules: its unloading is
PEFT's alone, and the copy is patched (or not) as it was copied.
"""

from __future__ import annotations

# The PeftModel's instance attribute holding its PatchOf.
PATCH_ATTR = "_tigon_patch"
# What the patch sets on the PeftModel instance.
UNLOADS = ("merge_and_unload", "unload")


class PatchOf:
    """The ``Patch`` of a ``PeftModel``'s base model (set once the patch is applied); copies hold none."""

    def __init__(self):
        self.patch = None

    def __reduce__(self):
        return type(self), ()


def _unloaded(peft_model, name, args, kwargs):
    """PEFT's ``name`` (the tuner's: ``PeftModel`` hands it on), then the patch reverted."""
    model = getattr(peft_model.base_model, name)(*args, **kwargs)
    holder = vars(peft_model).get(PATCH_ATTR)
    if holder is not None and holder.patch is not None:
        holder.patch.revert()
    return model


def merge_and_unload(self, *args, **kwargs):
    """PEFT's ``merge_and_unload``, then tigon's patch of the model reverted: a plain transformers model."""
    return _unloaded(self, "merge_and_unload", args, kwargs)


def unload(self, *args, **kwargs):
    """PEFT's ``unload`` (the base weights without the adapters), then tigon's patch reverted."""
    return _unloaded(self, "unload", args, kwargs)


merge_and_unload._tigon = True
unload._tigon = True


def plan_unloads(plan, wrapper) -> PatchOf | None:
    """Queue the unloads on ``wrapper`` (a PEFT model whose tuner unloads); the :class:`PatchOf` to fill."""
    from tigon.patching.instance_methods import InstanceMethod
    from tigon.patching.patch_handle import SetAttr

    tuner = getattr(wrapper, "base_model", None)
    if not all(callable(getattr(tuner, name, None)) for name in UNLOADS):
        return None
    holder = PatchOf()
    plan.add(SetAttr(wrapper, PATCH_ATTR, holder))
    plan.add(SetAttr(wrapper, "merge_and_unload", InstanceMethod(wrapper, merge_and_unload)),
             f"{type(wrapper).__name__}.merge_and_unload / unload -> PEFT's, then this patch reverted "
             "(a plain transformers model)")
    plan.add(SetAttr(wrapper, "unload", InstanceMethod(wrapper, unload)))
    return holder
