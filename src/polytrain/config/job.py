"""The job description: one typed dataclass per component, composed by `JobConfig`.

ARCHITECTURE contract 2: the TOML file and the CLI flags are two views of these fields. Each
section validates its own ranges; `JobConfig` checks what spans sections (mesh against world
size, batch against replicas and micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from polytrain.config.base import option, positive
from polytrain.config.bounds import check_bounds
from polytrain.config.decentralized import GossipConfig, LocalSGDConfig, check_decentralized
from polytrain.config.devices import resolve_devices
from polytrain.config.parallel import ParallelConfig, PipelineConfig, PSConfig
from polytrain.errors import ConfigError, MeshError

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "GossipConfig",
    "JobConfig",
    "LaunchConfig",
    "LocalSGDConfig",
    "ModelConfig",
    "ObserveConfig",
    "OptimConfig",
    "PSConfig",
    "ParallelConfig",
    "PipelineConfig",
    "TrackerName",
    "TrainConfig",
]

TrackerName = Literal["tensorboard", "mlflow", "wandb"]


@dataclass
class ModelConfig:
    name: str = option(
        "gpt",
        "built-in model (gpt, mlp, cnn: AlexNet-style, resnet) or a factory "
        "'package.module:function'",
    )
    size: str = option("tiny", "named size of a built-in model: tiny, small, medium")
    n_layer: int | None = option(
        None, "number of blocks (cnn: convolution stages; resnet: residual blocks)"
    )
    n_embd: int | None = option(
        None,
        "width of the residual stream / hidden layers (cnn: fully connected layers; resnet: "
        "stem channels)",
    )
    n_head: int | None = option(None, "attention heads (gpt)")
    block_size: int | None = option(None, "context length in tokens")
    dropout: float = option(0.0, "dropout probability")
    loss: str = option(
        "auto",
        "cross_entropy, mse, or a function 'package.module:function' (predictions, targets) -> "
        "scalar; auto: cross_entropy for integer targets, mse for float targets",
    )
    batchnorm: Literal["global", "local"] = option(
        "global",
        "BatchNorm statistics: global (over the whole batch of a step, synchronised across "
        "data-parallel replicas: matches one process) or local (each replica / pipeline "
        "micro-batch its own)",
    )
    args: dict[str, Any] = option(
        {}, "keyword arguments of a factory model (a TOML table, e.g. [model.args] n_layer = 2)"
    )
    init_from: str = option(
        "",
        "start from these pretrained weights: a .safetensors file or a transformers "
        "save_pretrained directory (sharded included); step 0, no optimizer state ('' = the "
        "seed's initial weights)",
    )

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "block_size"):
            value = getattr(self, name)
            if value is not None:
                positive("model", name, value)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout = {self.dropout!r}: expected a value in [0, 1)")


@dataclass
class DataConfig:
    source: str = option(
        "pydoc",
        "'pydoc' (the Python docs corpus shipped with CPython), 'digits' (scikit-learn's 8x8 "
        "images of digits), a text file, a .npy token array, a .jsonl / .parquet / .arrow "
        "table (a 'text' or 'input_ids' column: a corpus; with 'targets': supervised), or a "
        ".safetensors / .npz file with 'inputs' and 'targets'",
    )
    val_fraction: float = option(0.1, "fraction of the data held out for validation")
    tokenizer: str = option(
        "char",
        "text to token ids: char (distinct characters), byte (UTF-8 bytes, 256 ids), a local "
        "tokenizer.json (Hugging Face tokenizers) or a transformers tokenizer directory",
    )
    objective: Literal["causal", "mlm"] = option(
        "causal",
        "token data's training objective: causal (predict the next token) or mlm (masked "
        "language modelling as BERT: a fraction of each window's tokens masked and predicted)",
    )
    mask_fraction: float = option(
        0.15, "objective = 'mlm': fraction of each window's tokens chosen for prediction"
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_fraction < 1.0:
            raise ConfigError(
                f"data.mask_fraction = {self.mask_fraction!r}: expected a value in (0, 1)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(
                f"data.val_fraction = {self.val_fraction!r}: expected a value in (0, 1)"
            )


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = option("adamw", "optimizer")
    lr: float = option(3e-3, "peak learning rate")
    momentum: float = option(0.0, "SGD momentum")
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW) or L2 (SGD)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 = off)")
    fused: bool = option(
        True,
        "torch's fused optimizer kernel: one pass over every tensor, and the step's NaN/Inf "
        "decision stays on the device (false: torch's default implementation)",
    )
    schedule: Literal["cosine", "constant"] = option("cosine", "learning-rate schedule")
    warmup_steps: int = option(20, "linear warm-up steps")
    min_lr_ratio: float = option(0.1, "cosine floor as a fraction of lr")

    def __post_init__(self) -> None:
        positive("optim", "lr", self.lr)
        positive("optim", "grad_clip", self.grad_clip, allow_zero=True)
        positive("optim", "weight_decay", self.weight_decay, allow_zero=True)
        positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"optim.momentum = {self.momentum!r}: expected a value in [0, 1)")
        for name in ("beta1", "beta2", "min_lr_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"optim.{name} = {value!r}: expected a value in [0, 1]")


@dataclass
class TrainConfig:
    steps: int = option(1200, "optimizer steps")
    global_batch_size: int = option(32, "samples per optimizer step, summed over all replicas")
    grad_accum: int = option(1, "micro-steps per optimizer step (no all-reduce in between)")
    seed: int = option(0, "seed of the initial weights and of the batch order")
    eval_every: int = option(200, "validation loss every N steps (0 = only at the end)")
    eval_batches: int = option(4, "batches in each validation")
    dtype: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "autocast compute dtype (fp16: with dynamic loss scaling, for GPUs without bf16)"
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "device of each worker; auto: cuda where torch sees a GPU, else cpu"
    )
    on_nonfinite: Literal["stop", "skip"] = option(
        "stop", "on a NaN/Inf loss: stop the run, or skip the update"
    )
    sample_tokens: int = option(200, "characters generated at the end (gpt only, 0 = none)")
    compile: bool = option(
        False,
        "torch.compile each repeated block (Inductor); the first step's compilation is "
        "reported apart as compile_s",
    )

    def __post_init__(self) -> None:
        positive("train", "steps", self.steps)
        positive("train", "global_batch_size", self.global_batch_size)
        positive("train", "grad_accum", self.grad_accum)
        positive("train", "eval_every", self.eval_every, allow_zero=True)
        positive("train", "eval_batches", self.eval_batches)
        positive("train", "sample_tokens", self.sample_tokens, allow_zero=True)
        if self.seed < 0:
            raise ConfigError(f"train.seed = {self.seed}: expected a non-negative integer")


@dataclass
class CheckpointConfig:
    dir: str = option("", "checkpoint directory ('' = no checkpoints)")
    every: int = option(0, "save every N steps (0 = only at the end when dir is set)")
    keep: int = option(3, "keep the newest K checkpoints")
    resume: bool = option(False, "resume from the newest valid checkpoint in dir")
    async_save: bool = option(False, "write checkpoints in the background")
    save_final: str = option("", "write the final full weights to this .safetensors path")
    adopt: bool = option(
        False,
        "resume from checkpoints in dir that another job wrote (other model, data, optimizer, "
        "batch or seed); they are never pruned",
    )

    def __post_init__(self) -> None:
        positive("checkpoint", "every", self.every, allow_zero=True)
        positive("checkpoint", "keep", self.keep)
        if self.resume and not self.dir:
            raise ConfigError(
                "checkpoint.resume = true needs checkpoint.dir: pass --checkpoint-dir DIR"
            )


@dataclass
class ObserveConfig:
    out_dir: str = option("", "run directory for metrics and logs ('' = runs/<time>)")
    log_every: int = option(10, "metrics line every N steps")
    progress: bool = option(True, "show a progress bar on rank 0")
    trace: str = option("", "write a Chrome trace of the run to this path")
    trackers: list[TrackerName] = option(
        [],
        "experiment trackers that also receive metrics.jsonl's records, from rank 0: "
        "tensorboard, mlflow, wandb (each needs the polytrain extra of its name); a comma list "
        "as a flag",
    )

    def __post_init__(self) -> None:
        positive("observe", "log_every", self.log_every)
        repeated = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if repeated:
            raise ConfigError(
                f"observe.trackers = {self.trackers!r} names {', '.join(repeated)} more than "
                "once: list each tracker once"
            )


@dataclass
class LaunchConfig:
    nproc: int | Literal["auto", "gpu"] = option(
        "auto",
        "worker processes on this node: a count, gpu (one per visible GPU), or auto (one per "
        "GPU on a cuda job, else 2); a built job holds the count",
    )
    nnodes: int = option(1, "number of nodes")
    node_rank: int = option(0, "rank of this node")
    rdzv_endpoint: str = option("", "host:port of the rendezvous ('' = loopback, one node)")
    max_restarts: int = option(0, "restarts of the worker group after a failure")
    timeout_s: float = option(
        300.0, "collective timeout in seconds; a rank that does not arrive is named and fails"
    )
    backend: Literal["auto", "gloo", "nccl"] = option("auto", "c10d backend")

    @property
    def num_procs(self) -> int:
        """``nproc`` as a count: a built `JobConfig` has resolved "auto" and "gpu"
        ([Note: device resolution])."""
        assert isinstance(self.nproc, int), f"launch.nproc = {self.nproc!r} is not resolved"
        return self.nproc

    def __post_init__(self) -> None:
        if isinstance(self.nproc, int):
            positive("launch", "nproc", self.nproc)
        positive("launch", "nnodes", self.nnodes)
        positive("launch", "max_restarts", self.max_restarts, allow_zero=True)
        positive("launch", "timeout_s", self.timeout_s)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"launch.node_rank = {self.node_rank}: expected 0..{self.nnodes - 1} "
                f"for {self.nnodes} node(s)"
            )
        if self.rdzv_endpoint:
            _, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"launch.rdzv_endpoint = {self.rdzv_endpoint!r}: expected HOST:PORT with a "
                    "port number 1-65535, e.g. --rdzv-endpoint 10.0.0.1:29500"
                )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(
                f"launch.nnodes = {self.nnodes} needs a rendezvous endpoint every node can "
                "reach: pass --rdzv-endpoint HOST:PORT"
            )


@dataclass
class JobConfig:
    strategy: Literal["manual", "auto"] = option(
        "manual",
        "'manual': the parallel, pipeline and ps sections as written; 'auto': the planner picks "
        "them (and the process count, up to launch.nproc) from a calibrated host profile",
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    localsgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def world_size(self) -> int:
        return self.launch.num_procs * self.launch.nnodes

    @property
    def num_trainers(self) -> int:
        """Ranks that hold model replicas (the world less parameter-server ranks)."""
        if self.parallel.sync == "ps" and not self.ps.colocate:
            return self.world_size - self.ps.servers
        return self.world_size

    def __post_init__(self) -> None:
        check_bounds(self)  # infinities and values too large to work, in any section
        # [Note: device resolution]: once, here, so the saved job names what ran
        self.train.device, self.launch.nproc = resolve_devices(self.train.device, self.launch.nproc)
        self._resolve_mesh()
        self._check_batch()
        self._check_fp16()

    def _check_fp16(self) -> None:
        """fp16's loss scaling lives in the step contract of the all-reduce families
        ([Note: dynamic loss scaling] in polytrain.core.loss_scale)."""
        if self.train.dtype != "fp16":
            return
        if self.parallel.sync != "allreduce":
            raise ConfigError(
                f"train.dtype = 'fp16' with parallel.sync = {self.parallel.sync!r}: dynamic "
                "loss scaling runs under sync = 'allreduce' only; use dtype 'bf16' or 'fp32'"
            )
        if self.parallel.pp > 1 and self.pipeline.schedule == "pipedream":
            raise ConfigError(
                "train.dtype = 'fp16' with pipeline.schedule = 'pipedream': PipeDream updates "
                "inside its stream, where a loss-scale overflow cannot skip the step; use "
                "gpipe or 1f1b, or dtype 'bf16'"
            )

    def _resolve_mesh(self) -> None:
        p = self.parallel
        trainers = self.num_trainers
        if self.parallel.sync == "ps" and self.ps.colocate and self.ps.servers > self.world_size:
            raise ConfigError(
                f"ps.servers = {self.ps.servers} with ps.colocate = true: colocated servers are "
                f"worker ranks, and there are {self.world_size}; use at most {self.world_size}"
            )
        if self.parallel.sync == "ps" and trainers < 1:
            raise ConfigError(
                f"ps.servers = {self.ps.servers} leaves no worker among {self.world_size} "
                f"ranks: use at most {self.world_size - 1} servers or launch more processes"
            )
        if self.ps.leaves and self.parallel.sync != "ps":
            raise ConfigError(
                f"ps.leaves = {self.ps.leaves!r} with parallel.sync = {self.parallel.sync!r}: "
                f"leaf servers belong to parameter-server jobs; set --sync ps, or ps.leaves = 0"
            )
        leaves = self.ps.leaves
        if self.parallel.sync == "ps" and isinstance(leaves, int) and trainers % max(leaves, 1):
            raise ConfigError(
                f"ps.leaves = {leaves} does not divide the {trainers} workers into groups of "
                f"{leaves}: use a divisor of {trainers}, or ps.leaves = 'host'"
            )
        if self.parallel.sync == "ps" and self.ps.spare_workers >= trainers:
            raise ConfigError(
                f"ps.spare_workers = {self.ps.spare_workers} leaves no worker to start the job "
                f"among {trainers} workers: use at most {trainers - 1} spare workers"
            )
        model_ranks = p.tp * p.pp
        if p.dp == 0:
            if trainers % model_ranks:
                raise MeshError(
                    f"tp x pp = {p.tp} x {p.pp} = {model_ranks} does not divide the "
                    f"{trainers} training ranks: choose tp and pp whose product divides "
                    f"{trainers}, or change --nproc"
                )
            p.dp = trainers // model_ranks
        elif p.dp * model_ranks != trainers:
            raise MeshError(
                f"dp x tp x pp = {p.dp} x {p.tp} x {p.pp} = {p.dp * model_ranks} does not "
                f"equal the {trainers} training ranks: set --nproc {p.dp * model_ranks} "
                f"or change the degrees"
            )
        if p.sync in ("gossip", "localsgd") and (p.tp > 1 or p.pp > 1):
            raise MeshError(
                f"parallel.sync = {p.sync!r} mixes whole-model replicas, but parallel.tp = "
                f"{p.tp}, parallel.pp = {p.pp}: set --tp 1 --pp 1"
            )
        if p.sync in ("gossip", "localsgd") and p.grad_compression != "none":
            raise ConfigError(
                f"parallel.grad_compression = {p.grad_compression!r} compresses the gradient "
                f"all-reduce, which parallel.sync = {p.sync!r} does not run: use --compress "
                "(gossip) or --grad-compression none"
            )
        if p.spatial > 1 and p.dp != p.spatial:
            raise MeshError(
                f"parallel.spatial = {p.spatial} must equal the data-parallel degree {p.dp} "
                "(every rank holds one band; data parallel across spatial groups is not built "
                f"yet): set --nproc {p.spatial}"
            )
        check_decentralized(
            p.sync, self.world_size, self.launch.num_procs, self.gossip, self.localsgd
        )
        if p.zero and p.sync != "allreduce":
            raise ConfigError(
                f"parallel.zero = {p.zero} needs parallel.sync = 'allreduce', not {p.sync!r}"
            )

    def _check_batch(self) -> None:
        p, t = self.parallel, self.train
        per_step = p.dp * t.grad_accum * self.pipeline.microbatches
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                f"dp x grad_accum x microbatches = {p.dp} x {t.grad_accum} x "
                f"{self.pipeline.microbatches} = {per_step}: use a multiple of {per_step}"
            )
