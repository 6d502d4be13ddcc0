"""``tigon warmup``: compile, before training starts, every Triton kernel a training step of a model launches.

Every rank of a job compiles the same kernels on its first step, and a cold cache costs minutes on a large
model. Warmup builds the model with one decoder layer of each kind it has (every layer of one kind launches
the same kernels: a Llama needs one, Gemma-2's sliding and full attention layers two, a model with dense and
mixture-of-experts layers one of each), random weights, on the GPU; patches it with ``tigon.patch``; and runs
a training forward and backward (the loss through the model's own vocabulary, as training computes it) for
each sequence length asked for. Triton writes what it compiles into its cache, where the training processes
find it.

What a kernel is compiled for. Triton specialises a kernel on its dtypes and on which integer arguments are
multiples of 16 (or equal 1); tigon's launch settings follow the hidden size, the vocabulary, and, for short
inputs, the number of tokens. So the kernels depend on the model, the dtypes (bf16 weights, or fp32 weights
under bf16 autocast: different kernels), the switches, and batch x sequence length only through those
properties: warm with the batch and lengths you train with.

The cache. Triton keys every entry by the kernel's source, the Triton version, the GPU architecture and the
specialisation, and writes each file atomically (a temporary file renamed into place), so several processes
may share a cache on one node's local disk. An entry records its files by absolute path, so a cache works
only at the path it was written at: a copy elsewhere misses. ``--cache-dir DIR`` warms into a fresh folder
inside ``DIR`` and then publishes each new entry into ``DIR`` with one rename (its recorded paths rewritten to
``DIR``'s): a reader sees an entry whole or not at all, and several warmups may publish into one ``DIR``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

STAGING_PREFIX = ".tigon-warmup-"  # a warmup's folder inside the cache it publishes into
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class WarmupError(ValueError):
    """A model, switch or cache folder warmup cannot use (the CLI prints it and exits 2)."""


# ------------------------------------------------------------------------------------------ the model


def builtin_models() -> dict[str, tuple[str, str]]:
    """Built-in shape names (lower case) -> (label, model_type): the published shapes the benchmarks
    train (``Llama-3.2-1B-shaped`` ...), and every family ``tigon.patch`` supports by its
    ``model_type`` (its published shape here, or the family at Llama-3.2-1B's dimensions)."""
    from tigon.bench.models import FULL_SHAPES
    from tigon.patching import supported_models

    names = {}
    for model_type, (label, _) in FULL_SHAPES.items():
        names[label.lower()] = (label, model_type)
        names[label.lower().removesuffix("-shaped")] = (label, model_type)
    for model_type in supported_models():
        names.setdefault(model_type, (model_type, model_type))
    return names


def resolve_config(name: str):
    """``(label, config)`` for ``name``: a local folder holding ``config.json`` or a ``config.json``
    path, a built-in shape name, or a model on the Hugging Face hub (its config only is fetched)."""
    import transformers

    from tigon.bench.models import model_config

    path = Path(name).expanduser()
    if path.exists():
        try:
            return str(path), transformers.AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as err:
            raise WarmupError(f"model {name!r}: no transformers config could be read there ({err})") from err
    builtin = builtin_models().get(name.lower())
    if builtin is not None:
        label, model_type = builtin
        spec = model_config(model_type, tiny=False)
        return (label if label != model_type else spec.label), spec.config
    try:
        return name, transformers.AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        shapes = sorted({label for label, _ in builtin_models().values() if label.endswith("-shaped")})
        raise WarmupError(
            f"model {name!r} is not a local folder or config.json, not a built-in shape ({', '.join(shapes)}, or a "
            f"model_type tigon.patch supports), and its config could not be read from the Hugging Face hub: {err}"
        ) from err


def _decoder_layers(model, num_layers: int):
    """The language model's decoder layer list: a ModuleList of ``num_layers`` layers, one named
    ``...layers`` outside a vision tower first."""
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers]
    lists.sort(key=lambda item: not (item[0].endswith("layers") and "vision" not in item[0]))
    if not lists:
        raise WarmupError(f"{type(model).__name__}: no list of {num_layers} decoder layers found")
    return lists[0][1]


def _layer_kind(layer, index: int, text_config) -> tuple:
    """What makes one decoder layer launch other kernels than another: its attention type (the config's
    ``layer_types``), its module classes and its parameter shapes."""
    layer_types = getattr(text_config, "layer_types", None)
    structure = tuple(
        (name, type(module).__name__, tuple(tuple(p.shape) for p in module.parameters(recurse=False)))
        for name, module in layer.named_modules()
    )
    return (layer_types[index] if layer_types else None, getattr(layer, "attention_type", None), structure)


def layers_needed(config) -> int:
    """The fewest leading decoder layers that include one of every kind the model has (the whole model
    is built on the meta device to look, which allocates nothing)."""
    import transformers

    text_config = config.get_text_config()
    num_layers = text_config.num_hidden_layers
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError) as err:
        raise WarmupError(f"{type(config).__name__}: not a model transformers builds as a causal LM ({err})") from err
    kinds = [_layer_kind(layer, i, text_config) for i, layer in enumerate(_decoder_layers(model, num_layers))]
    last_new = max(kinds.index(kind) for kind in set(kinds))
    return last_new + 1


def truncated_config(config, num_layers: int):
    """A copy of ``config`` with its first ``num_layers`` decoder layers only."""
    config = copy.deepcopy(config)
    text_config = config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None)
    text_config.num_hidden_layers = num_layers
    if layer_types:
        text_config.layer_types = list(layer_types[:num_layers])
    return config


# ------------------------------------------------------------------------------------------ the cache


def triton_cache_dir() -> Path:
    """Where Triton reads and writes compiled kernels: ``TRITON_CACHE_DIR``, else ``~/.triton/cache``."""
    from triton import knobs

    return Path(knobs.cache.dir)


def cache_entries(cache_dir: Path) -> set[str]:
    """The entries (one folder per compiled kernel or launcher) in a Triton cache."""
    if not cache_dir.is_dir():
        return set()
    return {entry.name for entry in cache_dir.iterdir()
            if entry.is_dir() and not entry.name.startswith(("tmp.", "."))}


def entry_name(entry: Path) -> str:
    """A cache entry's kernel name (from its metadata), or its file's name for a compiled launcher."""
    for meta in sorted(entry.glob("*.json")):
        if meta.name.startswith("__grp__"):
            continue
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            name = None
        if name:
            return name
    files = sorted(p.name for p in entry.iterdir() if not p.name.startswith("__grp__"))
    return files[0] if files else entry.name


def publish(source: Path, target: Path) -> list[str]:
    """Move each entry of the cache ``source`` that ``target`` lacks into ``target``, each with one
    atomic rename (``source`` and ``target`` on one filesystem), after pointing the paths its group
    file records at ``target``. Returns the entries published; one that appeared in ``target``
    meanwhile (another warmup's: the same key, the same content) is left as it is."""
    target.mkdir(parents=True, exist_ok=True)
    published = []
    for name in sorted(cache_entries(source)):
        entry = source / name
        for group in entry.glob("__grp__*"):
            data = json.loads(group.read_text())
            data["child_paths"] = {
                child: str(target / name / Path(path).name) for child, path in data.get("child_paths", {}).items()
            }
            group.write_text(json.dumps(data))
        (entry / "lock").unlink(missing_ok=True)
        try:
            os.rename(entry, target / name)
        except OSError:
            if not (target / name).is_dir():
                raise
            continue
        published.append(name)
    return published


# ------------------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class WarmupResult:
    label: str
    layers: int
    cache_dir: Path
    kernels: Counter  # kernel name -> entries compiled
    seconds: float
    interpreter: bool


def parse_switches(items) -> dict:
    """``["name=value", ...]`` -> ``tigon.patch`` keywords (true/false, integers and floats as such)."""
    switches = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise WarmupError(f"--switch {item!r}: expected NAME=VALUE (e.g. recompute_norms=true)")
        lowered = value.lower()
        if lowered in ("true", "on", "yes"):
            switches[name] = True
        elif lowered in ("false", "off", "no"):
            switches[name] = False
        else:
            try:
                switches[name] = int(value)
            except ValueError:
                try:
                    switches[name] = float(value)
                except ValueError:
                    switches[name] = value
    return switches


# Backward passes per sequence length before the gradients are dropped: the second adds into the gradients
# the first left, as gradient accumulation does, in case a kernel is specialised on that.
MICRO_BATCHES = 2


def train_steps(model, *, seqs, batch: int, dtype: torch.dtype, autocast: bool, device: torch.device) -> None:
    """Forward (the loss through the model's head) and backward, ``MICRO_BATCHES`` times per sequence length."""
    vocab = model.config.get_text_config().vocab_size
    for seq in seqs:
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(vocab, (batch, seq), device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_warmup_model(config, *, device: torch.device, dtype: torch.dtype, autocast: bool, switches: dict,
                       lora: int = 0, qlora: bool = False):
    """The model at the layers warmup needs, random weights on ``device`` (fp32 under autocast, else
    ``dtype``), patched. sdpa attention as the benchmarks build it, or eager attention where the model
    refuses sdpa (Gemma-2 with its attention-logit softcap), as transformers then runs it. ``lora``: PEFT
    LoRA adapters of that rank on every linear layer but the head (its base frozen: the backward makes no
    weight gradients, other kernels); ``qlora``: those layers bitsandbytes 4-bit first (:func:`with_adapters`)."""
    import transformers

    import tigon
    from tigon.bench.models import build_model

    try:
        model = build_model(config, device=device)
    except ValueError:
        try:
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
        except ValueError as err:
            raise WarmupError(f"{type(config).__name__}: transformers cannot build it ({err})") from err
    if not autocast:
        model = model.to(dtype)
    if lora or qlora:
        model = with_adapters(model, rank=lora or QLORA_RANK, qlora=qlora, device=device, dtype=dtype)
    try:
        patch = tigon.patch(model, **switches)
    except (TypeError, ValueError) as err:
        raise WarmupError(f"tigon.patch: {err}") from err
    return model, patch


QLORA_RANK = 16  # --qlora's adapters without --lora (TRL's and PEFT's examples use 16)


def with_adapters(model, *, rank: int, qlora: bool, device: torch.device, dtype: torch.dtype):
    """``model`` as LoRA trains it: with ``qlora`` its linear layers but the head bitsandbytes 4-bit (nf4, double
    quant, ``dtype`` compute) and prepared as TRL prepares a 4-bit model; then a PEFT ``PeftModel`` with adapters
    of ``rank`` (α = 2·rank, no dropout) on those layers, PEFT's fp32 adapters over a 16-bit base."""
    try:
        import peft
    except ImportError as err:
        raise WarmupError("--lora and --qlora need PEFT (pip install peft)") from err
    if qlora:
        if dtype == torch.float32:
            raise WarmupError("--qlora: 4-bit bases compute in bf16 or fp16 (--dtype)")
        try:
            from tigon.bench.models import quantize_4bit

            quantize_4bit(model, device, dtype)
        except ImportError as err:
            raise WarmupError("--qlora needs bitsandbytes (pip install bitsandbytes)") from err
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(model, config).train()


def warmup(name: str, *, seqs=(2048,), batch: int = 1, dtype: str = "bf16", autocast: bool = False,
           switches=None, device: str = "cuda", cache_dir: str | None = None, lora: int = 0, qlora: bool = False,
           log=print) -> WarmupResult:
    """Compile every kernel a training step of ``name`` launches into the Triton cache (see the module
    docstring); ``cache_dir``: publish into that folder rather than write into Triton's cache in place;
    ``lora``, ``qlora``: with adapters of that rank, on 4-bit bases (:func:`build_warmup_model`)."""
    from tigon._interpreter import interpreter_active

    if dtype not in DTYPES:
        raise WarmupError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if batch < 1 or not seqs or min(seqs) < 1:
        raise WarmupError("batch and every seq must be positive")
    if lora < 0:
        raise WarmupError(f"--lora {lora}: a LoRA rank is positive")
    switches = dict(switches or {})
    start = time.perf_counter()
    label, config = resolve_config(name)
    layers = layers_needed(config)
    small = truncated_config(config, layers)

    staging, previous_dir = None, os.environ.get("TRITON_CACHE_DIR")
    if cache_dir is not None:
        target = Path(cache_dir).expanduser().resolve()
        target.mkdir(parents=True, exist_ok=True)
        # staged inside the target: on its filesystem, so that each entry's rename is atomic
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target))
        os.environ["TRITON_CACHE_DIR"] = str(staging)
    compiled_into = triton_cache_dir()
    before = cache_entries(compiled_into)
    log(f"tigon warmup: {label}, {layers} of {config.get_text_config().num_hidden_layers} decoder layers "
        f"(one of each kind), {'fp32 weights under ' + dtype + ' autocast' if autocast else dtype + ' weights'}, "
        f"batch {batch} x seq {', '.join(map(str, seqs))}, on {device}"
        + (f"; LoRA r={lora or QLORA_RANK} on every linear layer but the head" if lora or qlora else "")
        + ("; bitsandbytes 4-bit nf4 bases" if qlora else ""))
    try:
        dev = torch.device(device)
        model, patch = build_warmup_model(small, device=dev, dtype=DTYPES[dtype], autocast=autocast,
                                          switches=switches, lora=lora, qlora=qlora)
        for line in patch.replaced:
            log(f"  patched: {line}")
        train_steps(model, seqs=seqs, batch=batch, dtype=DTYPES[dtype], autocast=autocast, device=dev)
        new = sorted(cache_entries(compiled_into) - before)
        kernels = Counter(entry_name(compiled_into / entry) for entry in new)
        final_dir = compiled_into
        if staging is not None:
            publish(staging, target)
            final_dir = target
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            if previous_dir is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous_dir
    return WarmupResult(label, layers, final_dir, kernels, time.perf_counter() - start, interpreter_active())


def report(result: WarmupResult, log=print) -> None:
    if result.interpreter:
        log("Triton's CPU interpreter ran the kernels: nothing was compiled (warmup fills a GPU's cache).")
        return
    total = sum(result.kernels.values())
    if total == 0:
        log(f"nothing new to compile: every kernel was already in {result.cache_dir}")
    else:
        log(f"compiled {total} kernel variants into {result.cache_dir}:")
        for name, count in sorted(result.kernels.items()):
            log(f"  {name}" + (f" x{count}" if count > 1 else ""))
    log(f"done in {result.seconds:.1f} s; point TRITON_CACHE_DIR at {result.cache_dir} in the training processes "
        "(on the same node, the same path)")
