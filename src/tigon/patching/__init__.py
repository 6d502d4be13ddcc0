"""Hugging Face transformers in one line: ``tigon.patch(model)`` (API.md, last section).

``families.py`` is the data (one row per ``model_type``), ``engine.py`` the one engine that applies a
row to a model instance or to a ``model_type``'s classes, ``loss.py`` the generic CausalLM loss path,
``auto.py`` the patched ``AutoModelForCausalLM``.
"""

from tigon.patching.auto import AutoModelForCausalLM
from tigon.patching.changes import Patch
from tigon.patching.engine import SWITCHES, patch, supported_models
from tigon.patching.families import FAMILIES, Family
from tigon.patching.trl import patch_trl

__all__ = ["FAMILIES", "SWITCHES", "AutoModelForCausalLM", "Family", "Patch", "patch", "patch_trl", "supported_models"]
