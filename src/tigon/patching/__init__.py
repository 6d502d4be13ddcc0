"""Hugging Face transformers in one line: ``tigon.patch(model)`` (API.md, last section).

``families.py`` is the data (one row per ``model_type``); ``engine.py`` the one engine that resolves a row and
walks its parts (``parts/``: each part plans and describes its own swap) over a model instance or a
``model_type``'s classes; ``patch_handle.py`` the changes and the ``Patch`` that reverts them; the other modules
the transformers wiring the parts install (which module gets which forward), over the compute of ``tigon.nn``
and ``tigon.ops``; ``auto.py`` the patched ``AutoModelForCausalLM``, ``trl.py`` TRL's fused head on tigon.
"""

from tigon.patching.auto import AutoModelForCausalLM
from tigon.patching.engine import SWITCHES, patch, supported_models
from tigon.patching.families import FAMILIES, Family
from tigon.patching.patch_handle import Patch
from tigon.patching.trl import patch_trl

__all__ = ["FAMILIES", "SWITCHES", "AutoModelForCausalLM", "Family", "Patch", "patch", "patch_trl", "supported_models"]
