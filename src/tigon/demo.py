"""``tigon demo``: the same training run twice, stock transformers and ``tigon.patch``.

One randomly initialised model is built twice from the same seed (the weights are checked to be
identical) and trained on the same batches in the same order, once as transformers ships it and once
patched with ``tigon.patch(model)``. The demo prints tokens/s, peak GPU memory and the per-step loss
agreement (max over steps of ``|loss_tigon - loss_stock| / |loss_stock|``), shows a progress bar on
stderr while it runs, saves a PNG plot (loss curves, throughput and memory bars) and a JSON record
to ``--out``, and exits 1 if the losses disagree beyond the tolerance of the run's precision.

Data needs no download:

- by default a synthetic corpus drawn from a small probabilistic grammar (sentences with
  subject-verb number agreement, Zipf-distributed words, prepositional phrases, and two-digit
  additions ``7 plus 8 is 1 5 .``): learnable at several depths, so the loss falls steadily. Its
  symbols are spread evenly over the model's *whole* vocabulary, so the embedding and the loss head
  are as large as in real training and every region of them is used;
- ``--data FILE``: a local text file, tokenised offline at the byte level (byte ``b`` becomes token
  ``floor(b * vocab / 256)``, again spread over the whole vocabulary). It is not a real tokenizer,
  and nothing is downloaded.

On a GPU: a Llama-3.2-1B-shaped model by default (or the real shape of ``--model``'s family where
one is written out below, otherwise that family at Llama-3.2-1B's dimensions), bf16 autocast, fused
AdamW, sdpa attention; losses must agree within 2e-2 (bf16 rounding differs between the two runs).
On a CPU-only machine: a tiny config, fp32, tigon's kernels under Triton's CPU interpreter (slow,
exact; tokens/s there says nothing about GPU speed); losses must agree within 1e-4.

The configs here are also what ``benchmarks/e2e.py`` builds its models from.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tigon.bench.models import GPU_BATCH_OVERRIDES, ModelSpec, build_model, model_config, parameter_count


def fingerprint(model) -> float:
    """A number that differs between two differently initialised models (sum of |w| per tensor)."""
    with torch.no_grad():
        return sum(p.detach().double().abs().sum().item() for p in model.parameters())


# -------------------------------------------------------------------------------------------- data


def spread(num_symbols: int, vocab_size: int) -> torch.Tensor:
    """Token ids for symbols 0..n-1, evenly spaced over the whole vocabulary: floor(i * V / n)."""
    if num_symbols > vocab_size:
        raise ValueError(f"{num_symbols} symbols do not fit a vocabulary of {vocab_size}")
    return torch.arange(num_symbols, dtype=torch.int64) * vocab_size // num_symbols


class Grammar:
    """A small probabilistic grammar whose sentences a language model learns at several depths.

    Sentence kinds (probabilities in brackets):

    - statement (0.8): ``NP[n] VP[n] .`` with ``NP[n] = Det[n] Adj* Noun[n] (Prep NP)?`` and
      ``VP[n] = Verb[n] NP?``; ``n`` is singular or plural and determiner, noun and verb agree in it
      (each noun and verb has two forms). Words within a class follow a Zipf law, so unigram,
      class-transition and agreement structure are each learnable.
    - addition (0.2): ``a plus b is c .`` with digits a, b and the one- or two-digit sum c, which
      is fully determined by what came before.

    Lexicon sizes grow with the vocabulary (``words`` nouns, verbs and adjectives, capped at 4096),
    and all symbols are then spread over the vocabulary (``spread``).
    """

    ZIPF = 1.1
    P_ADDITION = 0.2
    P_ADJECTIVE = 0.35  # each further adjective
    P_PREPOSITION = 0.25
    P_OBJECT = 0.6
    MAX_DEPTH = 2  # nested prepositional phrases
    FIXED = 40  # determiners, prepositions, digits, 'plus', 'is', '.'
    MAX_WORDS = 4096

    def __init__(self, vocab_size: int, seed: int = 0):
        words = min(self.MAX_WORDS, (vocab_size - self.FIXED) // 6)
        if words < 8:
            raise ValueError(f"vocab_size={vocab_size} is too small for the synthetic grammar (>= 88)")
        self.rng = random.Random(seed)
        sizes = {
            "det_sg": 4, "det_pl": 4, "prep": 8, "digit": 10, "plus": 1, "is": 1, "stop": 1,
            "adj": words, "noun_sg": words, "noun_pl": words, "verb_sg": words, "verb_pl": words,
        }
        self.first = {}
        start = 0
        for name, size in sizes.items():
            self.first[name] = start
            start += size
        self.num_symbols = start
        self.token_of = spread(start, vocab_size)  # symbol -> token id
        zipf = [1.0 / (rank + 1) ** self.ZIPF for rank in range(words)]
        self.zipf_cum = list(_cumulative(zipf))
        self.words = words

    def _word(self, cls: str) -> int:
        rank = self.rng.choices(range(self.words), cum_weights=self.zipf_cum)[0]
        return self.first[cls] + rank

    def _small(self, cls: str, size: int) -> int:
        return self.first[cls] + self.rng.randrange(size)

    def _noun_phrase(self, out: list, plural: bool, depth: int) -> None:
        number = "pl" if plural else "sg"
        out.append(self._small(f"det_{number}", 4))
        while self.rng.random() < self.P_ADJECTIVE:
            out.append(self._word("adj"))
        out.append(self._word(f"noun_{number}"))
        if depth < self.MAX_DEPTH and self.rng.random() < self.P_PREPOSITION:
            out.append(self._small("prep", 8))
            self._noun_phrase(out, self.rng.random() < 0.5, depth + 1)

    def sentence(self) -> list[int]:
        out: list[int] = []
        if self.rng.random() < self.P_ADDITION:
            a, b = self.rng.randrange(10), self.rng.randrange(10)
            digits = [a + b] if a + b < 10 else [1, a + b - 10]
            out += [self.first["digit"] + a, self.first["plus"], self.first["digit"] + b, self.first["is"]]
            out += [self.first["digit"] + d for d in digits]
        else:
            plural = self.rng.random() < 0.5
            self._noun_phrase(out, plural, 0)
            out.append(self._word("verb_pl" if plural else "verb_sg"))
            if self.rng.random() < self.P_OBJECT:
                self._noun_phrase(out, self.rng.random() < 0.5, 0)
        out.append(self.first["stop"])
        return out

    def tokens(self, count: int) -> torch.Tensor:
        """``count`` token ids of running text."""
        symbols: list[int] = []
        while len(symbols) < count:
            symbols += self.sentence()
        return self.token_of[torch.tensor(symbols[:count], dtype=torch.int64)]


def _cumulative(weights):
    total = 0.0
    for w in weights:
        total += w
        yield total


def synthetic_batches(vocab_size: int, batch: int, seq: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches ``(batch, seq)`` of the grammar's running text, cut into consecutive rows."""
    stream = Grammar(vocab_size, seed).tokens(steps * batch * seq)
    return list(stream.view(steps, batch, seq).unbind(0))


def byte_tokens(data: bytes, vocab_size: int) -> torch.Tensor:
    """Offline byte-level tokenisation: byte b -> floor(b * V / 256) (not a trained tokenizer)."""
    return spread(256, vocab_size)[torch.frombuffer(bytearray(data), dtype=torch.uint8).long()]


def file_batches(path, vocab_size: int, batch: int, seq: int, steps: int, seed: int = 0) -> list:
    """Windows of ``seq`` byte tokens at random (seeded) offsets of a local text file."""
    data = Path(path).read_bytes()
    if len(data) < seq:
        raise ValueError(f"--data {path}: {len(data)} bytes is shorter than one sequence ({seq}); "
                         "pass a smaller --seq or a longer file")
    tokens = byte_tokens(data, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq + 1, (steps, batch), generator=gen)
    windows = starts[..., None] + torch.arange(seq)  # (steps, batch, seq)
    return list(tokens[windows].unbind(0))


# ---------------------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything both runs share."""

    spec: ModelSpec
    device: torch.device
    batch: int
    seq: int
    steps: int
    lr: float
    seed: int
    autocast: torch.dtype | None  # None: full fp32
    tolerance: float
    interpreter: bool

    @property
    def warmup(self) -> int:
        """Steps left out of the throughput: the first ones compile kernels and fill caches."""
        return min(WARMUP_STEPS, self.steps - 1)


WARMUP_STEPS = 5
WARMUP_FRACTION = 0.1  # of the steps, linear learning-rate warm-up
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
GIB = 2**30
OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments


@dataclasses.dataclass
class Run:
    label: str
    losses: list = dataclasses.field(default_factory=list)
    step_seconds: list = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None
    params: int = 0
    error: str | None = None
    replaced: list = dataclasses.field(default_factory=list)
    fingerprint: float = 0.0

    def tokens_per_s(self, setup: Setup) -> float | None:
        timed = self.step_seconds[setup.warmup:]
        if not timed:
            return None
        return setup.batch * setup.seq / statistics.median(timed)

    def activation_bytes(self) -> int | None:
        if self.peak_bytes is None:
            return None
        return self.peak_bytes - OPTIMIZER_BYTES_PER_PARAM * self.params


class Progress:
    """A plain text progress bar on stderr (redrawn in place on a terminal, a few lines otherwise)."""

    WIDTH = 30
    LINES_WHEN_PIPED = 4

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.next_line = 1

    def update(self, done: int, loss: float, tokens_per_s: float | None) -> None:
        filled = self.WIDTH * done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        rate = f"  {_si(tokens_per_s)} tok/s" if tokens_per_s else ""
        line = f"{self.label:<6} [{bar}] {done:>4}/{self.total}  loss {loss:.4f}{rate}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
            self.stream.flush()
        elif done * self.LINES_WHEN_PIPED >= self.next_line * self.total or done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.next_line = done * self.LINES_WHEN_PIPED // self.total + 1


def _learning_rate(setup: Setup, step: int) -> float:
    warm = max(1, round(WARMUP_FRACTION * setup.steps))
    return setup.lr * min(1.0, (step + 1) / warm)


def train(setup: Setup, label: str, batches, *, patch: bool) -> Run:
    """Build the model from the seed, optionally patch it, and train it on ``batches``."""
    import tigon

    run = Run(label)
    cuda = setup.device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(setup.seed)
    model = build_model(setup.spec.config, device=setup.device)
    run.params = parameter_count(model)
    run.fingerprint = fingerprint(model)
    if patch:
        run.replaced = tigon.patch(model).replaced
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                  fused=cuda)
    progress = Progress(label, setup.steps)
    if cuda:  # the peak of training (weights included), not of the fingerprint's temporaries
        torch.cuda.reset_peak_memory_stats()
    try:
        for step, ids in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(setup, step)
            ids = ids.to(setup.device, non_blocking=True)
            start = time.perf_counter()
            with torch.autocast(setup.device.type, dtype=setup.autocast, enabled=setup.autocast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.losses.append(loss.item())  # synchronises: the step time below is the device's
            run.step_seconds.append(time.perf_counter() - start)
            progress.update(step + 1, run.losses[-1], run.tokens_per_s(setup))
    except torch.OutOfMemoryError:
        run.error = "out of memory"
        print(f"\n{label}: out of memory at step {len(run.losses) + 1}", file=sys.stderr)
    if cuda:
        run.peak_bytes = torch.cuda.max_memory_allocated()
    del model, optimizer
    return run


def loss_agreement(stock: Run, tigon_run: Run) -> float | None:
    """max over steps of |loss_tigon - loss_stock| / |loss_stock| (None if a run did not finish;
    infinite if a loss is not finite)."""
    if stock.error or tigon_run.error or not stock.losses:
        return None
    if not all(math.isfinite(v) for v in stock.losses + tigon_run.losses):
        return math.inf
    return max(abs(t - s) / abs(s) for s, t in zip(stock.losses, tigon_run.losses, strict=True))


# ------------------------------------------------------------------------------------------ report


def _si(value) -> str:
    if value is None:
        return "—"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def _gib(value) -> str:
    return "—" if value is None else f"{value / GIB:.1f} GiB"


def _ratio(new, old) -> str:
    return f"{new / old:.2f}x" if new is not None and old else ""


def table(setup: Setup, stock: Run, tigon_run: Run) -> str:
    cuda = setup.device.type == "cuda"
    rows = [("", "stock", "tigon.patch", "tigon / stock")]
    for name, fn, fmt in (
        ("tokens/s", lambda r: r.tokens_per_s(setup), _si),
        ("peak GPU memory", lambda r: r.peak_bytes, _gib),
        ("activation memory", lambda r: r.activation_bytes(), _gib),
    ):
        if name != "tokens/s" and not cuda:
            rows.append((name, "n/a (CPU)", "n/a (CPU)", ""))
            break
        s, t = (None if r.error else fn(r) for r in (stock, tigon_run))
        rows.append((name, stock.error or fmt(s), tigon_run.error or fmt(t), _ratio(t, s)))
    final = [f"{r.losses[-1]:.4f}" if r.losses else "—" for r in (stock, tigon_run)]
    rows.append(("final loss", *final, ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(agreement_line(setup, stock, tigon_run))
    if cuda:
        lines.append("activation memory = peak - 16 bytes x parameters "
                     "(fp32 weights, grads, two AdamW moments)")
    if setup.interpreter:
        lines.append("tigon's kernels ran under Triton's CPU interpreter: its tokens/s here says nothing "
                     "about GPU speed")
    return "\n".join(lines)


def agreement_line(setup: Setup, stock: Run, tigon_run: Run) -> str:
    diff = loss_agreement(stock, tigon_run)
    precision = "fp32" if setup.autocast is None else "bf16 autocast"
    if diff is None:
        return "loss agreement: not measured (a run did not finish)"
    verdict = "OK" if diff <= setup.tolerance else "DISAGREE"
    return (f"loss agreement: max relative difference over {len(stock.losses)} steps {diff:.1e} "
            f"(tolerance {setup.tolerance:.0e}, {precision}): {verdict}")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(
            "tigon demo saves a PNG plot and needs matplotlib: pip install 'tigon[demo]' "
            "(or pip install matplotlib)"
        )


def plot(setup: Setup, stock: Run, tigon_run: Run, path: Path) -> None:
    """Three panels: loss per step (both runs), tokens/s bars, peak/activation memory bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (stock, tigon_run)
    labels = ("stock", "tigon.patch")
    colours = ("tab:gray", "tab:orange")
    fig, (ax_loss, ax_rate, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2),
                                                    gridspec_kw={"width_ratios": [2.2, 1, 1]})
    for run, label, colour, style in zip(runs, labels, colours, ("-", "--"), strict=True):
        ax_loss.plot(range(1, len(run.losses) + 1), run.losses, style, color=colour, label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    diff = loss_agreement(stock, tigon_run)
    ax_loss.set_title("loss" if diff is None else f"loss (max relative difference per step {diff:.1e})")
    ax_loss.legend()

    rates = [r.tokens_per_s(setup) or 0.0 for r in runs]
    ax_rate.bar(labels, rates, color=colours)
    for x, value in enumerate(rates):
        ax_rate.text(x, value, _si(value), ha="center", va="bottom")
    ax_rate.set_ylabel("tokens/s" + (" (Triton interpreter)" if setup.interpreter else ""))
    ax_rate.set_title("throughput")

    if setup.device.type == "cuda":
        peaks = [(r.peak_bytes or 0) / GIB for r in runs]
        acts = [max(0.0, (r.activation_bytes() or 0) / GIB) for r in runs]
        ax_mem.bar(labels, peaks, color=colours, alpha=0.45, label="peak")
        ax_mem.bar(labels, acts, color=colours, label="activations")
        for x, value in enumerate(peaks):
            ax_mem.text(x, value, f"{value:.1f}", ha="center", va="bottom")
        ax_mem.set_ylabel("GiB")
        ax_mem.legend(fontsize=8)
    else:
        ax_mem.text(0.5, 0.5, "CPU run:\nGPU memory not measured", ha="center", va="center",
                    transform=ax_mem.transAxes)
        ax_mem.set_xticks([])
        ax_mem.set_yticks([])
    ax_mem.set_title("memory")
    precision = "fp32" if setup.autocast is None else "bf16 autocast"
    fig.suptitle(f"tigon demo: {setup.spec.label}, batch {setup.batch} x {setup.seq}, {setup.steps} steps, "
                 f"{precision}, {device_name(setup.device)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def record(setup: Setup, stock: Run, tigon_run: Run, data: str) -> dict:
    return {
        "model": setup.spec.label,
        "model_type": setup.spec.model_type,
        "device": device_name(setup.device),
        "interpreter": setup.interpreter,
        "batch": setup.batch,
        "seq": setup.seq,
        "steps": setup.steps,
        "warmup_steps_not_timed": setup.warmup,
        "lr": setup.lr,
        "seed": setup.seed,
        "precision": "fp32" if setup.autocast is None else "bf16 autocast",
        "data": data,
        "tolerance": setup.tolerance,
        "max_relative_loss_difference": loss_agreement(stock, tigon_run),
        "runs": {
            run.label: {
                "losses": run.losses,
                "step_seconds": run.step_seconds,
                "tokens_per_s": run.tokens_per_s(setup),
                "peak_bytes": run.peak_bytes,
                "activation_bytes": run.activation_bytes(),
                "params": run.params,
                "error": run.error,
                "replaced": run.replaced,
            }
            for run in (stock, tigon_run)
        },
    }


# -------------------------------------------------------------------------------------------- main

GPU_DEFAULTS = dict(model="llama", batch=4, seq=2048, steps=50, lr=3e-4)
TINY_GPU_DEFAULTS = dict(model="llama", batch=8, seq=512, steps=50, lr=3e-3)
CPU_DEFAULTS = dict(model="llama", batch=4, seq=64, steps=24, lr=3e-3)
TOLERANCE = {None: 1e-4, torch.bfloat16: 2e-2}  # per-step relative loss difference, by autocast dtype


def run_demo(*, model=None, batch=None, seq=None, steps=None, lr=None, seed=0, data=None,
             out="tigon-demo", tiny=False, log=print) -> int:
    """The ``tigon demo`` command; returns the exit status (0 agree, 1 disagree, 2 bad usage)."""
    from tigon._interpreter import use_interpreter_without_gpu

    interpreter = use_interpreter_without_gpu()  # before anything imports tigon.ops
    import tigon

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    defaults = CPU_DEFAULTS if not cuda else TINY_GPU_DEFAULTS if tiny else GPU_DEFAULTS
    model = model or defaults["model"]
    if cuda and not tiny:
        defaults = {**defaults, "batch": GPU_BATCH_OVERRIDES.get(model, defaults["batch"])}
    chosen = dict(batch=batch, seq=seq, steps=steps, lr=lr)
    batch, seq, steps, lr = (defaults[k] if v is None else v for k, v in chosen.items())
    try:
        require_matplotlib()
        if model not in tigon.supported_models():
            raise ValueError(f"--model {model!r} is not supported; choose one of {tigon.supported_models()}")
        for name, value in (("batch", batch), ("seq", seq), ("steps", steps)):
            if value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        if not lr > 0:
            raise ValueError(f"--lr must be positive, got {lr}")
        spec = model_config(model, tiny=tiny or not cuda)
        vocab = spec.config.vocab_size
        if data is None:
            batches = synthetic_batches(vocab, batch, seq, steps, seed)
            data_label = "synthetic grammar corpus (symbols spread over the whole vocabulary)"
        else:
            batches = file_batches(data, vocab, batch, seq, steps, seed)
            data_label = f"{data}, byte-level tokens spread over the vocabulary (offline, no tokenizer)"
    except (ValueError, ModuleNotFoundError, OSError) as err:
        print(f"tigon demo: {err}", file=sys.stderr)
        return 2
    autocast = torch.bfloat16 if cuda else None
    setup = Setup(spec, device, batch, seq, steps, lr, seed, autocast, TOLERANCE[autocast], interpreter)

    if not cuda:
        log("No CUDA device: running a tiny config on the CPU, tigon's kernels under Triton's interpreter "
            "(exact but slow; the real demo is a Llama-3.2-1B-shaped model on a GPU).")
    precision = "fp32" if autocast is None else "bf16 autocast"
    log(f"tigon demo: {spec.label} ({model}), random init, seed {seed}, batch {batch} x {seq}, {steps} steps")
    log(f"{precision}, {'fused ' if cuda else ''}AdamW lr {lr:g}, sdpa attention, on {device_name(device)}")
    log(f"data: {data_label}")

    stock = train(setup, "stock", batches, patch=False)
    tigon_run = train(setup, "tigon", batches, patch=True)
    if stock.fingerprint != tigon_run.fingerprint:
        print("tigon demo: the two runs did not start from the same weights", file=sys.stderr)
        return 1
    log(f"parameters: {stock.params / 1e6:.1f}M; tigon.patch replaced:")
    for line in tigon_run.replaced:
        log(f"  {line}")

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(record(setup, stock, tigon_run, data_label), indent=1))
    plot(setup, stock, tigon_run, out_dir / "demo.png")
    log("")
    log(table(setup, stock, tigon_run))
    log(f"wrote {out_dir / 'demo.png'} and {out_dir / 'demo.json'}")
    if tigon_run.error:
        return 1
    diff = loss_agreement(stock, tigon_run)
    return 0 if diff is None or diff <= setup.tolerance else 1
