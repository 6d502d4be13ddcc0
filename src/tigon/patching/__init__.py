"""The transformers integration (issue: data-driven patching engine); nothing shipped yet."""
