"""The model part of a node namespace: :mod:`kvferry.namespace`, shared with the SGLang
connector (kept here for the imports that name it)."""

from ..namespace import MAX_PART, model_namespace

__all__ = ["MAX_PART", "model_namespace"]
