"""The connector's link to its node: :mod:`kvferry.link`, shared with the SGLang connector
(kept here for the imports that name it)."""

from ..link import MAX_RETRY_S, NodeDown, NodeLink, default_factory, is_node_failure

__all__ = ["MAX_RETRY_S", "NodeDown", "NodeLink", "default_factory", "is_node_failure"]
