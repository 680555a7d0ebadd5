"""Training a GPT-2 (or its Post-LN twin) with our own modules on a token stream.

The softmax runs over the tokens the training text uses plus one shared "any other token" row,
not all 50,257: on the Shakespeare corpus that is ~19,000 rows, 2.7x less work in the LM head.
It is exact, not an approximation: the written model's embedding gives every unused token that
shared row, so the full-vocabulary softmax of the written model equals this softmax with the
shared row's logit raised by log(number of unused tokens) (`TokenSpace.offset`), and the loss
trained and reported is the full-vocabulary loss.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from model.config import GPT2Config
from model.gpt2 import GPT2
from model.post_ln import PostLNConfig, PostLNGPT
from weights.random_init import init_state

ARCHITECTURES = {"pre-ln": (GPT2, GPT2Config), "post-ln": (PostLNGPT, PostLNConfig)}
OPTIMIZERS = ("adamw", "muon")
LOSS_CHUNK_ROWS = 1024  # rows of logits alive at once in the loss: [1024, K] float32 ≈ 78 MB


@dataclass(frozen=True)
class TrainConfig:
    architecture: str = "pre-ln"
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 4
    context: int = 256
    batch_size: int = 8
    steps: int = 600
    lr: float = 4e-3
    min_lr: float = 1e-4
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "muon"  # Muon for the blocks' matrices, AdamW for the rest; or "adamw" for all
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
            raise ValueError(f"optimizer 'muon' needs torch >= 2.9 (torch.optim.Muon), this is {torch.__version__}; use adamw")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {list(ARCHITECTURES)}, got {self.architecture!r}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


class TokenSpace:
    """The training softmax's rows: the K token ids the training text uses, then one shared row."""

    def __init__(self, train_ids: np.ndarray, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.kept = np.unique(train_ids)  # [K] full ids, sorted
        self.other = len(self.kept)  # index of the shared row
        self.compact_of = np.full(vocab_size, self.other, dtype=np.int64)
        self.compact_of[self.kept] = np.arange(len(self.kept))
        self.unused = vocab_size - len(self.kept)
        self.offset = torch.zeros(self.size)  # [K + 1] added to the logits
        self.offset[self.other] = math.log(self.unused) if self.unused else -math.inf

    @property
    def size(self) -> int:
        return len(self.kept) + 1

    def compact(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.compact_of[ids])

    def full_embedding(self, compact: torch.Tensor) -> torch.Tensor:
        """[K + 1, C] trained rows -> [V, C]: every unused token gets the shared row."""
        full = compact[self.other].expand(self.vocab_size, -1).clone()
        full[torch.from_numpy(self.kept)] = compact[: self.other]
        return full


def orthogonalize_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation, as torch.optim.Muon runs it but in float32.

    torch runs it in bfloat16, which a CPU without bfloat16 matrix units (AVX2, AVX-512 without
    BF16) emulates: on this project's AVX2 machine the Muon step took 16 of a training step's
    20 seconds, and 0.3 in float32 (bench figure in docs/models.md).
    """
    a, b, c = ns_coefficients
    wide = grad.size(0) <= grad.size(1)
    ortho = grad.float() if wide else grad.float().T
    ortho = ortho / ortho.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho if wide else ortho.T


@contextlib.contextmanager
def muon_in_float32() -> Iterator[None]:
    """Within the block, torch.optim.Muon orthogonalises in float32 (`orthogonalize_float32`).
    It swaps a private function of torch's; tests/weights/test_trainer_muon.py fails, naming it,
    if a torch upgrade moves it."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = orthogonalize_float32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor):
    logits = hidden @ weight.t() + offset  # [n, K + 1]
    log_z = logits.logsumexp(dim=-1)  # [n]
    nll = log_z - logits.gather(1, targets[:, None])[:, 0]  # [n]
    return logits, log_z, nll


class TiedCrossEntropy(torch.autograd.Function):
    """Sum of token NLLs of a tied LM head, computed and differentiated chunk by chunk so the
    [N, K] logits never exist at once (the gradient of softmax cross-entropy is p − onehot)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, offset):  # hidden [N, C], weight [K+1, C], targets [N]
        total = hidden.new_zeros(())
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        for start in range(0, hidden.shape[0], LOSS_CHUNK_ROWS):
            rows = slice(start, start + LOSS_CHUNK_ROWS)
            logits, log_z, nll = _chunk_nll(hidden[rows], weight, targets[rows], offset)
            total += nll.sum()
            grad_logits = logits.sub_(log_z[:, None]).exp_()  # softmax, in place
            grad_logits[torch.arange(len(grad_logits)), targets[rows]] -= 1.0
            grad_hidden[rows] = grad_logits @ weight
            if ctx.needs_input_grad[1]:  # a frozen head (LoRA training) skips a third of the work
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None


def token_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [N] without gradients (evaluation)."""
    with torch.no_grad():
        return torch.cat([
            _chunk_nll(hidden[s:s + LOSS_CHUNK_ROWS], weight, targets[s:s + LOSS_CHUNK_ROWS], offset)[2]
            for s in range(0, hidden.shape[0], LOSS_CHUNK_ROWS)
        ])


def heldout_windows(stream: np.ndarray, context: int) -> list[np.ndarray]:
    """Consecutive windows of context + 1 tokens sharing one token: every token after the first
    is a target exactly once."""
    return [stream[s:s + context + 1] for s in range(0, len(stream) - 1, context)]


@dataclass
class TrainState:
    model: nn.Module
    config: TrainConfig
    space: TokenSpace
    step: int = 0  # optimizer steps taken
    interrupted: bool = False
    diverged: bool = False  # the loss became inf or NaN; training stopped there
    seconds: float = 0.0


Observer = Callable[[int, nn.Module], None]  # called after backward, before clipping


class Trainer:
    def __init__(self, config: TrainConfig, train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int) -> None:
        self.config = config
        self.space = self.token_space(train_ids, vocab_size)
        self.train_ids = self.space.compact(train_ids)
        self.model = self.build_model()
        self.batches = torch.Generator().manual_seed(config.seed + 1)
        windows = heldout_windows(heldout_ids, config.context)
        pick = np.linspace(0, len(windows) - 1, num=min(config.eval_windows, len(windows))).astype(int)
        self.eval_windows = [windows[i] for i in pick]  # spread over the held-out works
        self.record: dict = {"config": asdict(config), "train_loss": [], "heldout_loss": []}

    def token_space(self, train_ids: np.ndarray, vocab_size: int) -> TokenSpace:
        """The softmax's rows: the tokens the training text uses (a fresh model learns no other)."""
        return TokenSpace(train_ids, vocab_size)

    def build_model(self) -> nn.Module:
        """The model trained: a fresh one of config's architecture over the compact token space."""
        model_class, config_class = ARCHITECTURES[self.config.architecture]
        self.model_config = config_class(
            vocab_size=self.space.size, n_positions=self.config.context,
            n_embd=self.config.n_embd, n_layer=self.config.n_layer, n_head=self.config.n_head,
        )
        model = model_class(self.model_config)
        # GPT-2's initialisation for both architectures, so twins differ only by where the
        # LayerNorms sit.
        model.load_state_dict(init_state(self.model_config, seed=self.config.seed, model_class=model_class))
        return model

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean NLL of ids[:, 1:] given what precedes them: [B, T + 1] compact ids."""
        out = self.model(ids[:, :-1], apply_head=False)
        hidden = out.head_input.reshape(-1, self.model_config.n_embd)
        total = TiedCrossEntropy.apply(hidden, self.model.tied_embedding, ids[:, 1:].reshape(-1), self.space.offset)
        return total / hidden.shape[0]

    def batch(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.train_ids) - self.config.context - 1, (self.config.batch_size,), generator=self.batches)
        return torch.stack([self.train_ids[s:s + self.config.context + 1] for s in starts.tolist()])

    def heldout_nll(self, windows: list[np.ndarray]) -> float:
        """Mean full-vocabulary NLL (nats/token) of every target of the windows."""
        per_window = self.heldout_token_nll(windows)
        return float(sum(nll.double().sum() for nll in per_window)) / sum(len(nll) for nll in per_window)

    def heldout_token_nll(self, windows: list[np.ndarray]) -> list[torch.Tensor]:
        """Each window's per-target full-vocabulary NLLs (nats)."""
        per_window = []
        self.model.eval()
        with torch.no_grad():
            for window in windows:
                ids = self.space.compact(window)[None]  # [1, T + 1]
                out = self.model(ids[:, :-1], apply_head=False)
                targets = ids[0, 1:]
                nll = token_nll(out.head_input[0], self.model.tied_embedding, targets, self.space.offset)
                # A token outside the kept rows is one of `unused` tokens sharing the other row.
                per_window.append(nll + (targets == self.space.other) * math.log(max(self.space.unused, 1)))
        self.model.train()
        return per_window

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """AdamW for everything; or Muon (torch.optim.Muon, its update scaled to AdamW's RMS so
        one learning rate serves both) for the blocks' matrices and AdamW for the embeddings,
        biases and LayerNorms."""
        blocks = {id(p) for p in self.model.h.parameters()}
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        muon = self.config.optimizer == "muon"
        orthogonal = [p for p in matrices if muon and id(p) in blocks]
        decay = [p for p in matrices if not (muon and id(p) in blocks)]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        config = self.config
        optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=(0.9, 0.95), foreach=True,
        )]
        if orthogonal:
            optimizers.append(torch.optim.Muon(orthogonal, lr=config.lr, weight_decay=config.weight_decay,
                                               adjust_lr_fn="match_rms_adamw"))
        return optimizers

    def run(self, observer: Observer | None = None, progress: bool = True) -> TrainState:
        """Train for config.steps. Ctrl-C stops where it is and leaves a usable model; state.step
        counts the steps completed."""
        config, state = self.config, TrainState(self.model, self.config, self.space)
        optimizers = self.optimizers()
        self.model.train()
        started = time.perf_counter()
        bar = tqdm(total=config.steps, desc="train", disable=not progress, dynamic_ncols=True)
        running = None
        try:
            for step in range(config.steps):
                if step % config.eval_every == 0:
                    self._evaluate(step, bar)
                for group in (g for o in optimizers for g in o.param_groups):
                    group["lr"] = config.lr_at(step)
                loss = self.loss(self.batch())
                if not torch.isfinite(loss):
                    state.diverged = True
                    bar.write(f"step {step}: loss {loss.item()}; stopping")
                    break
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if observer is not None:
                    observer(step, self.model)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
                with muon_in_float32():
                    for optimizer in optimizers:
                        optimizer.step()
                value = loss.item()
                running = value if running is None else 0.9 * running + 0.1 * value
                self.record["train_loss"].append([step, round(value, 5), round(float(grad_norm), 5)])
                state.step = step + 1
                bar.update(1)
                bar.set_postfix(loss=f"{running:.3f}")
        except KeyboardInterrupt:
            state.interrupted = True
            bar.write(f"interrupted after {state.step} steps; writing what was trained")
        bar.close()
        state.seconds = time.perf_counter() - started
        return state

    def _evaluate(self, step: int, bar: tqdm) -> None:
        loss = self.heldout_nll(self.eval_windows)
        self.record["heldout_loss"].append([step, round(loss, 5)])
        bar.write(f"step {step}: held-out loss {loss:.4f} (sample of {len(self.eval_windows)} windows)")
