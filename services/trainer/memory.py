"""The trainer's memory plan: bytes per GPU for a model, a parallel layout and a token budget, computed from the
model's ``config.json`` alone (no weights, no GPU), so that a layout that cannot fit is refused before minutes of
loading, and ``turnstream trainer plan`` can propose one that does.

Each figure is the largest pipeline stage's (the first, which holds the embedding and, under 1F1B, PP
micro-batches in flight; or the last, with the output layer and the logits). The activation model counts, per
layer, the tensors Megatron-core's local layer (``get_gpt_layer_local_spec``) keeps for backward; it was derived
from and is tested against the bytes that autograd actually saves on this CPU (``tests/services/trainer/
test_memory.py``), in fp32 and bf16, for Llama and Qwen3 layers. Per token and layer, with ``w`` the bytes of the
model's dtype, ``h`` the hidden size and Q/K/F this rank's query, key and FFN widths:

- two RMSNorms: ``(8 + w) h`` (an fp32 copy and the normalised fp32 values, the output in ``w``) + 8 (rstd);
- SwiGLU MLP: ``5 w F`` (the fused gate/up output, silu, the product);
- attention: ``w Q`` (the context), and for the core attention ``3 w Q`` (q, and k and v repeated to every query
  head under GQA) plus the probabilities ``b x heads x s^2`` per micro-batch, fp32 with a ``w`` copy for the
  value product. Selective recompute keeps q, k and the fused QKV output instead and no probabilities;
  Qwen3's q/k norms add their fp32 internals.
- full recompute keeps only each layer's input (``w h``) and reruns one layer at a time in backward.

The logits cost ``2 w V`` per token (kept for the loss and their gradient) plus the loss's float32 chunk. Weights
``w``, gradients 4 (reduced in fp32), Adam 8 and, in bf16, the fp32 main copy 4 bytes per parameter; the
distributed optimizer shards the last two over data-parallel ranks. A fixed reserve covers the CUDA context,
NCCL buffers and allocator fragmentation.

With LoRA (``trainer.lora``) the base weights are frozen: gradients, Adam and the main copy exist for the adapters
alone (``rank x (in + out)`` per adapted projection, split as ``lora.py`` splits them), and the adapters' own
weights are added. Activations are counted as without LoRA: the frozen layer keeps no input for a weight gradient
and the adapter keeps that input instead; its rank-wide intermediates are a few per cent of one layer's.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

import msgspec

from runtime.configuration.config import TrainerConfig
from services.trainer.spec import ModelSpec, lora_split_dim, padded_vocab

GIB = 1024**3
LOSS_CHUNK = 1024
"""Positions per pass of the loss (``logprobs.CHUNK``; this module imports no torch)."""
RECOMPUTE = ("none", "selective", "full")
DEFAULT_RESERVE_GIB = 4.0


class PlanInput(msgspec.Struct, frozen=True):
    """What a memory plan depends on besides the model."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_tokens: int = 8192
    seq_len: int = 0
    """The longest sequence of a micro-batch (0: ``micro_batch_tokens``, one sample filling the budget)."""
    recompute: str = "selective"
    distributed_optimizer: bool = True
    dtype_bytes: int = 2
    """2: bf16 weights with fp32 main weights in the optimizer; 4: fp32 throughout."""
    reference: bool = False
    """A frozen reference model (``TrainerConfig.reference_copy``)."""
    vocab_parallel_logits: bool = True
    """The loss reads each rank's vocab slice, as the trainer does (False: the logits gathered over the vocab on
    every TP rank, as it did before)."""
    attention: str = "sdpa"
    """The trainer's attention (``trainer.layer_spec`` resolved): ``sdpa``, torch's flash kernels in Megatron's
    local layer (q, k, v, the output and one log-sum-exp per head and position kept; measured on the CPU's flash
    kernel); ``te``, Transformer Engine's fused attention (q, k, v and the softmax statistics: an estimate from
    the kernels' documented saved state, not measured here; the GPU smoke script compares it with
    ``torch.cuda.max_memory_allocated``); ``local``, Megatron's own (the ``s x s`` probabilities)."""
    max_sample_tokens: int = 0
    """The longest sample the trainer accepts (``trainer.max_sample_tokens``; 0: ``micro_batch_tokens``). One
    longer than the budget is a micro-batch of its own: the plan is the larger of a full budget and one such
    sample."""
    reserve_gib: float = DEFAULT_RESERVE_GIB
    lora_rank: int = 0
    """LoRA adapters of this rank on ``lora_targets`` train instead of the model (0: full fine-tuning)."""
    lora_targets: tuple[str, ...] = ()


class MemoryPlan(msgspec.Struct, frozen=True):
    """Bytes per GPU, by what holds them."""

    layout: PlanInput
    params: int
    """Parameters on the largest stage's rank."""
    trainable: int
    """Of which (or, with LoRA, besides which) trained: what gradients and the optimizer hold."""
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    logits: int
    reserve: int

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.reference
            + self.activations
            + self.logits
            + self.reserve
        )

    def rows(self) -> list[tuple[str, float]]:
        """(what, GiB) in the order people read them."""
        return [
            ("weights", self.weights / GIB),
            ("gradients", self.gradients / GIB),
            ("optimizer", self.optimizer / GIB),
            ("reference", self.reference / GIB),
            ("activations", self.activations / GIB),
            ("logits", self.logits / GIB),
            ("reserve", self.reserve / GIB),
            ("total", self.total / GIB),
        ]

    def describe(self) -> str:
        lay = self.layout
        head = (
            (f"LoRA rank {lay.lora_rank}, " if lay.lora_rank else "")
            + f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp}, {lay.micro_batch_tokens} tokens per micro-batch, "
            f"recompute {lay.recompute}, distributed optimizer {'on' if lay.distributed_optimizer else 'off'}, "
            f"{'bf16' if lay.dtype_bytes == 2 else 'fp32'}"
        )
        return head + ": " + ", ".join(f"{name} {gib:.1f} GiB" for name, gib in self.rows())


def layer_params(spec: ModelSpec, tp: int) -> int:
    h, hd = spec.hidden_size, spec.head_dim
    qkv = h * (spec.num_heads + 2 * spec.num_kv_heads) * hd // tp
    proj = spec.num_heads * hd * h // tp
    mlp = 3 * spec.ffn_hidden_size * h // tp
    norms = 2 * h + (2 * hd if spec.family == "qwen3" else 0)
    return qkv + proj + mlp + norms


def lora_layer_params(spec: ModelSpec, tp: int, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of one layer on one tensor-parallel rank, split as ``lora.py`` splits them
    (``lora_split_dim``)."""
    total = 0
    for proj in targets:
        out, inp = spec.projection_shape(proj)
        for which, size in (("A", rank * inp), ("B", out * rank)):
            total += size // (tp if lora_split_dim(proj, which) is not None else 1)
    return total


def stage_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> int:
    """Parameters on one rank of pipeline stage ``stage``."""
    vocab_rows = padded_vocab(spec.vocab_size, tp) // tp
    n = spec.num_layers // pp * layer_params(spec, tp)
    if stage == 0:
        n += vocab_rows * spec.hidden_size
    if stage == pp - 1:
        n += spec.hidden_size  # the final norm
        if (
            not spec.tie_embeddings or pp > 1
        ):  # its own output layer, or the last stage's copy of the tied one
            n += vocab_rows * spec.hidden_size
    return n


def layer_activations(spec: ModelSpec, lay: PlanInput, recompute: str | None = None) -> int:
    """Bytes one layer keeps for backward for one micro-batch (see the module docstring)."""
    recompute = recompute or lay.recompute
    w, tp = lay.dtype_bytes, lay.tp
    t = lay.micro_batch_tokens
    s = lay.seq_len or t
    b = max(1, t // s)
    h, hd = spec.hidden_size, spec.head_dim
    heads, kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
    q, k, f = heads * hd, kv_heads * hd, spec.ffn_hidden_size // tp
    if recompute == "full":
        return w * t * h
    gqa = heads != kv_heads
    total = 2 * ((8 + w) * t * h + 4 * t)  # input and pre-MLP RMSNorms
    total += 5 * w * t * f  # SwiGLU
    total += w * t * q  # the context, input of the output projection
    total += 4 * w * s * hd  # RoPE's cos and sin for q and k
    fused_qkv_kept = False
    if spec.family == "qwen3":  # q/k RMSNorms over each head
        k_norm = (
            8 if w != 4 else (4 if gqa else 0)
        )  # fp32 without GQA: k's normed values are what attention keeps
        total += 8 * t * q + k_norm * t * k + 4 * t * (heads + kv_heads)
        fused_qkv_kept = w == 4  # the fp32 norm reads the fused QKV output in place
    if lay.attention == "te":  # q, k, v and the log-sum-exp per head and token; nothing sequence x sequence
        total += w * t * (q + 2 * k) + 4 * t * heads
    elif (
        recompute == "selective"
    ):  # the core attention's inputs only: q, k, and v as a view of the fused output
        total += w * t * (q + k)
        fused_qkv_kept = True
    else:
        total += w * t * (3 * q if gqa else 2 * q)
        fused_qkv_kept = fused_qkv_kept or not gqa  # without GQA, v is a view of the fused output
        if (
            lay.attention == "sdpa"
        ):  # the kernel's log-sum-exp per head and position (its output is the context)
            total += 4 * t * heads
        else:
            total += b * heads * s * s * (4 if w == 4 else 4 + w)  # probabilities: fp32 softmax (+ a w copy)
    if fused_qkv_kept:
        total += w * t * (q + 2 * k)
    return total


def attention_workspace(spec: ModelSpec, lay: PlanInput) -> int:
    """The transient peak of one layer's local attention in backward beyond what it keeps: the probabilities'
    gradient (fp32), and under selective recompute the recomputed probabilities (fp32 and the ``w`` copy) too.
    Under full recompute the rerun layer keeps what ``none`` keeps and adds this. Nothing ``s x s`` for the
    flash kernels (``sdpa``, ``te``)."""
    if lay.attention != "local":
        return 0
    t = lay.micro_batch_tokens
    s = lay.seq_len or t
    b = max(1, t // s)
    heads = spec.num_heads // lay.tp
    kept = 0 if lay.recompute == "selective" else 4 + lay.dtype_bytes
    return b * heads * s * s * (8 + lay.dtype_bytes - kept)


def logits_bytes(spec: ModelSpec, lay: PlanInput) -> int:
    """The output layer, applied to the response's positions ``LOSS_CHUNK`` at a time (``head.py``): one chunk's
    logits and their gradient in the model's dtype, the loss's float32 chunk, the gathered hidden states of
    every position and their gradient, the per-token figures. Under local attention, the ``[b, 1, s, s]`` mask."""
    vocab = padded_vocab(spec.vocab_size, lay.tp)
    v = vocab // lay.tp if lay.vocab_parallel_logits else vocab
    t = lay.micro_batch_tokens
    s = lay.seq_len or t
    chunk = min(LOSS_CHUNK, t)
    mask = max(1, t // s) * s * s if lay.attention == "local" else 0
    return (
        2 * lay.dtype_bytes * chunk * v
        + 3 * 4 * chunk * v
        + 2 * lay.dtype_bytes * t * spec.hidden_size
        + 24 * t
        + mask
    )


def shapes(lay: PlanInput) -> list[PlanInput]:
    """The micro-batch shapes the trainer can form: a full budget, and a longest sample alone when it exceeds it."""
    longest = lay.max_sample_tokens
    if longest <= lay.micro_batch_tokens:
        return [lay]
    return [lay, msgspec.structs.replace(lay, micro_batch_tokens=longest, seq_len=longest)]


def plan(spec: ModelSpec, lay: PlanInput) -> MemoryPlan:
    """The memory of the rank that needs most."""
    stages = range(lay.pp)
    params = max(stage_params(spec, lay.tp, lay.pp, st) for st in stages)
    adapters = spec.num_layers // lay.pp * lora_layer_params(spec, lay.tp, lay.lora_rank, lay.lora_targets)
    trainable = adapters if lay.lora_rank else params
    w = lay.dtype_bytes
    opt_per_param = 8 + (4 if w == 2 else 0)  # Adam's two moments, and the fp32 main weights under bf16
    shard = lay.dp if lay.distributed_optimizer else 1
    layers = spec.num_layers // lay.pp
    activations = 0
    logits = 0
    for shape in shapes(lay):
        per_layer = layer_activations(spec, shape)
        one_layer = layer_activations(spec, shape, "none") if lay.recompute == "full" else 0
        transient = one_layer + attention_workspace(spec, shape)
        for st in stages:
            in_flight = lay.pp - st  # 1F1B: stage st holds this many micro-batches' activations at its peak
            acts = in_flight * layers * per_layer + transient
            lgt = logits_bytes(spec, shape) if st == lay.pp - 1 else 0
            if acts + lgt > activations + logits:
                activations, logits = acts, lgt
    return MemoryPlan(
        layout=lay,
        params=params,
        trainable=trainable,
        weights=(params + adapters) * w,
        gradients=trainable * 4,
        optimizer=-(-trainable * opt_per_param // shard),
        reference=params * w if lay.reference else 0,
        activations=activations,
        logits=logits,
        reserve=int(lay.reserve_gib * GIB),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(spec: ModelSpec, gpus: int, base: PlanInput) -> Iterator[PlanInput]:
    """Every TP x PP x DP split of ``gpus`` that the model's heads, FFN and layers divide into (TP within a
    host's 8 GPUs), under each recompute setting."""
    for tp, pp in product(_divisors(gpus), _divisors(gpus)):
        if gpus % (tp * pp) or tp > 8:
            continue
        if spec.num_heads % tp or spec.num_kv_heads % tp or spec.ffn_hidden_size % tp:
            continue
        if spec.num_layers % pp:
            continue
        for recompute in RECOMPUTE:
            yield msgspec.structs.replace(
                base,
                tp=tp,
                pp=pp,
                dp=gpus // (tp * pp),
                recompute=recompute,
                distributed_optimizer=gpus // (tp * pp) > 1,
            )


def propose(spec: ModelSpec, gpus: int, gpu_gib: float, base: PlanInput) -> MemoryPlan | None:
    """The layout that fits ``gpu_gib`` with the least model parallelism (more data parallelism, fewer
    collectives per layer), then the least recompute, then the least memory; None when nothing fits."""
    fitting = [p for lay in layouts(spec, gpus, base) if (p := plan(spec, lay)).total <= gpu_gib * GIB]
    if not fitting:
        return None
    return min(
        fitting,
        key=lambda p: (p.layout.tp * p.layout.pp, p.layout.pp, RECOMPUTE.index(p.layout.recompute), p.total),
    )


class DoesNotFit(RuntimeError):
    """A layout whose plan exceeds the GPU's memory; the message carries the plan's figures."""


def check_fits(spec: ModelSpec, lay: PlanInput, gpu_gib: float) -> MemoryPlan:
    """Refuse, before anything is loaded, a layout that will not fit ``gpu_gib`` per GPU."""
    p = plan(spec, lay)
    if p.total > gpu_gib * GIB:
        raise DoesNotFit(
            f"the trainer's memory plan needs {p.total / GIB:.1f} GiB per GPU, more than the {gpu_gib:.1f} GiB "
            f"available: {p.describe()}. Try `turnstream trainer plan` for a layout that fits (more GPUs, "
            "tensor or pipeline parallelism, recompute full, a smaller trainer.micro_batch_tokens)."
        )
    return p


def resolve_recompute(setting: str, *, cuda: bool) -> str:
    """``trainer.recompute`` with ``auto`` resolved: ``full`` on the CPU (memory is what a CPU run lacks, and the
    rerun costs no measurable time there), ``selective`` on GPUs (Megatron's usual choice). Torch-free, so a
    deployment's plan (tests/test_compose.py) resolves it exactly as the trainer in its container will."""
    if setting != "auto":
        return setting
    return "selective" if cuda else "full"


def resolve_layer_spec(setting: str, *, te_usable: bool) -> str:
    """``trainer.layer_spec`` with ``auto`` resolved: ``te`` (fused attention) only where Transformer Engine is
    installed and CUDA runs; ``te`` refused elsewhere. The runtime image has no Transformer Engine: ``sdpa``."""
    if setting == "auto":
        return "te" if te_usable else "sdpa"
    if setting == "te" and not te_usable:
        raise ValueError("trainer.layer_spec te needs Transformer Engine and CUDA; use sdpa (or auto) here")
    return setting


def total_params(spec: ModelSpec) -> int:
    """The model's parameters (one copy; tied embeddings once)."""
    return stage_params(spec, 1, 1, 0)


def for_trainer(
    config: TrainerConfig,
    *,
    tp: int,
    pp: int,
    dp: int,
    dtype_bytes: int,
    recompute: str,
    attention: str = "sdpa",
) -> PlanInput:
    """The plan input of a trainer configuration as the trainer runs it."""
    return PlanInput(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_tokens=config.micro_batch_tokens,
        recompute=recompute,
        distributed_optimizer=config.distributed_optimizer,
        dtype_bytes=dtype_bytes,
        reference=config.reference_copy,
        attention=attention,
        max_sample_tokens=config.max_sample_tokens,
        lora_rank=config.lora.rank if config.lora.enabled else 0,
        lora_targets=tuple(config.lora.target_modules) if config.lora.enabled else (),
    )
