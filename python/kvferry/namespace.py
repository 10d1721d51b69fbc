"""The model part of a node namespace, from any model name an engine serves.

The node keys blocks by namespace ``model/dtype/fingerprint`` and takes each part as 1 to
128 printable ASCII characters without ``/``. Users name models by Hugging Face id
(``meta-llama/Llama-3.1-8B-Instruct``), by path (``/models/llama``) or by any served
name, so the name is escaped, and the escape is one-to-one: two different names never get
the same namespace, so two models never share blocks.

- A name that is already a valid part and holds no ``%`` is kept as it is (``llama8b``).
- Otherwise every byte of its UTF-8 form that is not printable ASCII, or is ``/`` or
  ``%``, becomes ``%XX`` (upper-case hex): ``meta-llama%2FLlama-3.1-8B-Instruct``.
- An escaped name longer than 128 characters is cut to its first 95 characters and
  ``%~`` and the first 31 hex digits of the SHA-256 of the name are appended. No escaped
  name holds ``%~`` (a ``%`` is always followed by two hex digits), so a cut name never
  equals an uncut one.

The readable name stays in logs next to the namespace. Nothing here imports an engine;
the vLLM and SGLang connectors both use it.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Mapping

__all__ = ["MAX_PART", "TENANT_PROTOCOL", "keeps_tenants", "model_namespace", "tenant_part"]

#: The node's engine protocol from which a Query or Save may name a tenant.
TENANT_PROTOCOL = 9

#: The node's longest namespace part (characters).
MAX_PART = 128
_CUT = MAX_PART - 2 - 31


def _plain(b: int) -> bool:
    return 0x21 <= b <= 0x7E and b not in (0x2F, 0x25)  # printable, not '/', not '%'


def model_namespace(name: str) -> str:
    """The node's namespace model part for model ``name`` (see the module doc)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"kvferry: a model name must be a non-empty string, got {name!r}")
    raw = name.encode("utf-8", "surrogatepass")
    out = "".join(chr(b) if _plain(b) else f"%{b:02X}" for b in raw)
    if len(out) <= MAX_PART:
        return out
    digest = hashlib.sha256(raw).hexdigest()[:31]
    return f"{out[:_CUT]}%~{digest}"


def tenant_part(name: str) -> str:
    """The node's tenant part for a tenant (a LoRA adapter) named ``name``: escaped as a
    model name is, so any adapter name is accepted and two names never share a namespace
    (the node keeps ``model/dtype/fingerprint/tenant`` apart, with its own quota and metric
    label)."""
    return model_namespace(name)


def keeps_tenants(caps: Mapping[str, Any], log: logging.Logger, what: str) -> bool:
    """Whether the node of Capabilities ``caps`` keeps tenants apart (protocol 9); where it
    does not, logs that LoRA adapters' ``what`` (blocks, pages) share their model's
    namespace (their salted hashes still never meet another adapter's)."""
    ok = int(caps.get("protocol") or 0) >= TENANT_PROTOCOL
    if not ok:
        log.warning(
            "kvferry: the node speaks engine protocol %s, older than %d: LoRA adapters' %s "
            "share their model's namespace and quota",
            caps.get("protocol"), TENANT_PROTOCOL, what,
        )
    return ok
