"""The training loop (`train`: AdamW, warmup then cosine decay, best-validation weights) and its parts:
the batches, the loss, the optimizer step, the loss over a token stream."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from mk.config import ModelConfig
from mk.model.train import forward, init_weights


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `floor`·peak at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq + 1] windows at seeded random offsets of the stream."""
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return stream[(starts[:, None] + torch.arange(seq + 1)).to(stream.device)]


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def stream_loss(
    cfg, weights, stream: torch.Tensor, seq: int, batch: int, device, max_batches=None
) -> tuple[float, torch.Tensor]:
    """Mean next-token loss (nats) over non-overlapping windows of the stream (all of it by default, else
    `max_batches` batches of evenly spaced windows), and the mean expert load [MoE layers, experts]."""
    n = (len(stream) - 1) // seq
    if n == 0:
        return float("nan"), torch.zeros(0)
    starts = torch.arange(n) * seq
    if max_batches is not None:
        starts = starts[torch.linspace(0, n - 1, min(n, max_batches * batch)).long()]
    total, count, load = 0.0, 0, 0.0
    for i in range(0, len(starts), batch):
        s = starts[i : i + batch]
        win = stream[s[:, None] + torch.arange(seq + 1)].to(device)
        with autocast(device):
            out = forward(cfg, weights, win[:, :-1])
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += win[:, 1:].numel()
        load = load + out.expert_load.float().cpu() * len(s)
    return total / count, load / len(starts)


def ul_reserved(args) -> float:
    """Seconds of --time-budget the unlikelihood phase takes (a replay's counted updates take none)."""
    return args.unlikelihood_seconds if args.unlikelihood_updates is None else 0.0


def main_loss(args, cfg, weights, win: torch.Tensor, device) -> tuple:
    """The training objective on windows [batch, seq + 1]: (next-token loss, it plus the routers'
    balance term, the forward's output)."""
    with autocast(device):
        out = forward(cfg, weights, win[:, :-1], dropout=args.dropout)
    lm = F.cross_entropy(out.logits.float().flatten(0, 1), win[:, 1:].flatten())
    return lm, lm + args.balance_coef * out.balance_loss, out


def optimizer_step(args, weights, opt, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(weights.values()), args.grad_clip)
    opt.step()


def train(args, cfg: ModelConfig, train_stream, val_stream, device: torch.device, log) -> dict:
    """The training loop; returns the best weights (lowest validation loss) and the history."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    weights = init_weights(cfg, seed=args.seed, device=device)
    decay = [t for t in weights.values() if t.dim() > 1]
    no_decay = [t for t in weights.values() if t.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    tokens_per_step = args.batch_size * args.seq_len
    epoch_steps = max(1, len(train_stream) // tokens_per_step)
    cap = max(1, int(args.max_epochs * epoch_steps))
    # total: the schedule's length; stop_at: where training stops (earlier only with --steps and --max-steps).
    if args.steps is not None:
        total, how = args.steps, "--steps"
        stop_at = min(total, args.max_steps or total)
    else:
        total, how = min(cap, args.max_steps or cap), "max-epochs cap" if not args.max_steps else "--max-steps"
        stop_at = total
    # Fixed before the first step, so a calibrated run replays exactly (report["replay"]).
    warmup = args.warmup if args.steps is not None or args.warmup < total // 2 else max(1, total // 10)
    budget = args.time_budget * 60 - ul_reserved(args)
    calib = (10, 60)  # steps timed (inside the warmup) to size the run when no --steps is given
    stream_dev = train_stream.to(device)

    hist = {k: [] for k in ("step", "tokens", "train_loss", "lr", "val_step", "val_loss")}
    hist.update(val_expert_load_min=[], val_expert_load_max=[])
    best = {"loss": float("inf"), "step": -1, "weights": None}
    run_loss = torch.zeros((), device=device)
    run_n = 0
    t0 = time.perf_counter()
    t_calib = None
    stopped_early = diverged = False
    step = 0

    def evaluate(step: int) -> None:
        v, load = stream_loss(cfg, weights, val_stream, args.seq_len, args.batch_size, device, args.eval_batches)
        hist["val_step"].append(step)
        hist["val_loss"].append(v)
        hist["val_expert_load_min"].append(float(load.min()) if load.numel() else 0.0)
        hist["val_expert_load_max"].append(float(load.max()) if load.numel() else 0.0)
        if v < best["loss"]:
            best.update(loss=v, step=step, weights={n: t.detach().clone() for n, t in weights.items()})
        log(f"step {step:6d}  val loss {v:.4f}  ({time.perf_counter() - t0:.0f} s)")

    while step < stop_at:
        if args.steps is None and step == calib[0]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if args.steps is None and step == calib[1] and t_calib is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_calib) / (calib[1] - calib[0])
            left = budget - (time.perf_counter() - t0)
            by_time = calib[1] + int(0.95 * left / (per_step * (1 + args.eval_batches / (2 * args.eval_every))))
            if by_time < total:
                total, how = max(calib[1] + 1, by_time), "time budget"
            stop_at = total
            log(f"calibration: {per_step * 1000:.1f} ms/step -> {total} steps ({how})")
        lr = lr_at(step, total, args.lr, warmup, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        win = batch_at(stream_dev, args.batch_size, args.seq_len, gen.manual_seed(args.seed * 1_000_003 + step))
        lm, loss, out = main_loss(args, cfg, weights, win, device)
        optimizer_step(args, weights, opt, loss)
        run_loss += lm.detach()
        run_n += 1
        step += 1
        if step % args.log_every == 0 or step == stop_at:
            hist["step"].append(step)
            hist["tokens"].append(step * tokens_per_step)
            hist["train_loss"].append(float(run_loss) / run_n)
            hist["lr"].append(lr)
            run_loss.zero_()
            run_n = 0
            if not math.isfinite(hist["train_loss"][-1]):
                log(f"training loss is {hist['train_loss'][-1]} at step {step}: stopping (best weights kept)")
                diverged = True
                break
            if step % (args.log_every * 10) == 0 or step == stop_at:
                load = out.expert_load
                log(
                    f"step {step:6d}/{total}  loss {hist['train_loss'][-1]:.4f}  lr {lr:.2e}  "
                    f"expert load min/max {float(load.min()):.3f}/{float(load.max()):.3f}  "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
        if step % args.eval_every == 0 and step < stop_at:
            evaluate(step)
        if time.perf_counter() - t0 > budget * 1.05:
            log(f"time budget reached at step {step} of {total}: stopping")
            stopped_early = True
            break
    evaluate(step)
    elapsed = time.perf_counter() - t0
    if best["weights"] is None:  # no finite validation loss at all: ship the last weights, flagged
        best["weights"] = {n: t.detach().clone() for n, t in weights.items()}
        diverged = True
    return {
        "weights": best["weights"],
        "state": (weights, opt),  # the last weights and their optimizer (the unlikelihood phase goes on from them)
        "best_step": best["step"],
        "best_val_loss": best["loss"],
        "steps": step,
        "planned_steps": total,
        "steps_set_by": how,
        "warmup": warmup,
        "stopped_early": stopped_early,
        "diverged": diverged,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / len(train_stream),
        "train_seconds": elapsed,
        "tokens_per_second": step * tokens_per_step / elapsed,
        "history": hist,
    }
