"""From `--model` to a loaded CausalLM: resolve the directory, read the config, pick dtype, load weights."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from shoal.engine import startup
from shoal.engine.execution.gguf_model import GGUFWeightSource, gguf_config, is_gguf
from shoal.engine.execution.layers.linear import PackedMatmul
from shoal.engine.execution.layers.moe import FusedMoE, plain_experts_format
from shoal.engine.execution.layers.weight_format import plain_format
from shoal.engine.execution.models import model_class, text_decoder_config
from shoal.engine.execution.weights import WeightError, WeightSource, load_threads

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local directory, or a hub id already present in the local Hugging Face cache (never the network)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _gguf_alone(path)
    if path.exists():
        if is_gguf(path):
            return path
        raise WeightError(f"{model}: is a file but not a GGUF file; --model takes a Hugging Face model directory, "
                          "a hub id or a .gguf file")
    if model.count("/") > 1 or model.startswith((".", "/", "~")):
        raise WeightError(f"{model}: no such model directory")
    from huggingface_hub import snapshot_download

    try:
        return _gguf_alone(Path(snapshot_download(model, revision=revision, local_files_only=True)))
    except Exception as e:
        raise WeightError(
            f"{model}: not a local directory and not in the local Hugging Face cache "
            f"(no network access is assumed; download it first or pass a directory): {e.__class__.__name__}"
        ) from None


def _gguf_alone(model_dir: Path) -> Path:
    """A folder without config.json that holds one GGUF file (a llama.cpp repository on the hub, as the model
    cache stores it) is that file; with several, which one is the user's choice."""
    if (model_dir / "config.json").exists():
        return model_dir
    ggufs = sorted(p for p in model_dir.glob("*.gguf") if is_gguf(p))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise WeightError(f"{model_dir}: no config.json and {len(ggufs)} GGUF files "
                          f"({', '.join(p.name for p in ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}); "
                          "pass one of them as --model DIR/FILE.gguf")
    return model_dir


def load_hf_config(model_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    if is_gguf(model_dir):
        return gguf_config(model_dir)
    if not (model_dir / "config.json").exists():
        raise WeightError(f"{model_dir}: config.json is missing")
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs as strict dataclasses

    try:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        # a vision-language checkpoint: its text decoder (and the family's tower where it has its image processor)
        return text_decoder_config(config, has_image_processor(model_dir))
    except (ValueError, StrictDataclassError) as e:
        raise WeightError(f"{model_dir}/config.json: {e}") from None
    except OSError as e:
        raise WeightError(f"{model_dir}/config.json: cannot be read ({e})") from None


def has_image_processor(model_dir: Path) -> bool:
    """Whether a checkpoint directory keeps an image processor's config (on its own, or in the processor's)."""
    if (model_dir / "preprocessor_config.json").exists():
        return True
    processor = model_dir / "processor_config.json"
    return processor.exists() and "image_processor" in processor.read_text()


def resolve_dtype(choice: str, hf_config, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return _DTYPES[choice]
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    from shoal.engine.execution.cpu_features import cpu_features

    features = cpu_features()
    if not features.bf16_native:
        # Without bf16 arithmetic in hardware, bf16 matmuls are emulated (3-5x slower than float32 here) and
        # oneDNN's fast bf16 paths refuse to run: float32 is both correct and fastest, at twice the memory.
        logger.info("--dtype auto: float32 instead of the checkpoint's %s: CPU tier %s has no native bf16 "
                    "(pass --dtype bfloat16 to halve weight memory at a speed cost)",
                    str(dtype).removeprefix("torch."), features.tier)
        return torch.float32
    if dtype == torch.float16:
        return torch.bfloat16  # CPU kernels for fp16 are slow and partly missing; bf16 has the same footprint
    return dtype


def choose_formats(model: torch.nn.Module, gguf_packed: bool, quantization: str | None) -> None:
    """Each layer's weight format (layers/weight_format.py), chosen once the checkpoint is read: a GGUF file's blocks
    where they were kept packed, then --quantization's forms, then the fastest plain form of every other layer."""
    if gguf_packed:
        from shoal.engine.execution.quantization.gguf import finish_gguf_model

        finish_gguf_model(model)
    if quantization is not None:
        from shoal.engine.execution.quantization import quantize_model

        quantize_model(model, quantization)
    for module in model.modules():
        if isinstance(module, PackedMatmul) and (module.format is None or module.format.runs_on_parameter):
            # a tied LM head's Parameter is the embedding table: a packed copy leaves it in place
            module.use(plain_format(module.weight), free_dense=not getattr(module, "tied", False))
        elif isinstance(module, FusedMoE) and module.format.runs_on_parameter:
            module.use(plain_experts_format(module))


def _gguf_packed(choice: bool | None, device: torch.device) -> bool:
    if choice is None:
        choice = os.environ.get("SHOAL_GGUF_DEQUANTIZE") != "1"
        if not choice:
            logger.info("GGUF weights are dequantized on load: SHOAL_GGUF_DEQUANTIZE=1")
    if not choice:
        return False
    from shoal.engine.execution.quantization.gguf import packed_unsupported_reason

    reason = packed_unsupported_reason(device)
    if reason:
        logger.info("GGUF weights are dequantized on load: %s", reason)
    return reason is None


def weight_source(model_dir: Path, hf_config, device: torch.device, gguf_packed: bool | None = None):
    """The checkpoint's tensors as the models read them (GGUF, safetensors; GPTQ/AWQ dequantized as read)."""
    if is_gguf(model_dir):
        src = GGUFWeightSource(model_dir, hf_config, packed=_gguf_packed(gguf_packed, device))
    else:
        src = WeightSource(model_dir, threads=load_threads())
    quant_config = getattr(hf_config, "quantization_config", None)
    if quant_config:  # GPTQ / AWQ: packed weights dequantized as they are read
        from shoal.engine.execution.quantization.prequantized import PrequantizedSource

        src = PrequantizedSource(src, quant_config)
    return src


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, backend,
               max_model_len: int, layer_partition: list[int] | None = None, quantization: str | None = None,
               gguf_packed: bool | None = None):
    """`gguf_packed`: keep a GGUF file's quantized weights in their blocks (the packed kernels: C++ on CPU, Triton
    on CUDA); default on unless SHOAL_GGUF_DEQUANTIZE=1 (dequantize on load, for comparisons)."""
    cls = model_class(hf_config)
    t0, built_before = time.perf_counter(), startup.seconds("kernel_build")
    with torch.device(device):  # allocate parameters where they will live; weights stream in tensor by tensor
        model = cls(hf_config, dtype, backend, max_model_len, layer_partition)
    src = weight_source(model_dir, hf_config, device, gguf_packed)
    try:
        model.load_weights(src)
    finally:
        src.close()
    model.eval()
    choose_formats(model, gguf_packed=getattr(src, "packed", False), quantization=quantization)
    seconds = time.perf_counter() - t0
    startup.add("weights", seconds - (startup.seconds("kernel_build") - built_before))  # builds count once
    logger.info("loaded %s (%s, %s) from %s in %.2fs (%d loader threads)", cls.__name__,
                str(dtype).removeprefix("torch."), device, model_dir, seconds, getattr(src, "threads", 1))
    return model
