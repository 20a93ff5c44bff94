"""The training loop: the draft learns the frozen main model's greedy next token at every block
position (what greedy verification accepts), the confidence head whether the draft's own top token
is that token. AdamW, linear warm-up then linear decay over a wall-clock budget."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools.dspark_train.draft_torch import DraftTorch


def block_loss(model: DraftTorch, tin, tokens, greedy, anchors):
    """(loss, top-1 agreement with the main model's greedy token [anchors, B]) of one sequence's
    anchors."""
    B = model.cfg.dspark_block_size
    xc, logits = model(tin, tokens, anchors)
    pos = anchors[:, None] + torch.arange(B, device=tin.device)
    bias, e = model.markov(tokens[pos])
    logits = logits + bias
    target = greedy[pos].long()
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    hit = (logits.argmax(-1) == target)
    conf = F.binary_cross_entropy_with_logits(model.confidence(xc, e), hit.float())
    return ce + 0.1 * conf, hit


def train(model: DraftTorch, work: Path, minutes: float, device: str, seqs: int = 8, anchors: int = 48,
          lr: float = 2e-3, log_every: int = 50) -> dict:
    """Train in place on work/{tokens,tin,greedy}.npy (the last 5% of the chunks held out);
    returns the held-out per-position agreement at the end."""
    tokens = np.load(work / "tokens.npy")
    tin = np.load(work / "tin.npy", mmap_mode="r")
    greedy = np.load(work / "greedy.npy")
    n, T = tokens.shape
    n_val = max(1, n // 20)
    B = model.cfg.dspark_block_size
    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.01)

    def batch(i):
        return (torch.from_numpy(np.asarray(tin[i], np.float32)).to(device),
                torch.from_numpy(tokens[i].astype(np.int64)).to(device),
                torch.from_numpy(greedy[i].astype(np.int64)).to(device))

    def evaluate() -> tuple[np.ndarray, float]:
        """Per block position, how often the draft's top token is the main model's; and the
        tokens a greedy verify step would emit on average (the agreeing prefix plus one), both
        teacher-forced on the held-out chunks."""
        model.eval()
        hits = []
        with torch.no_grad():
            for i in range(n - n_val, n):
                a = torch.arange(0, T - B + 1, 3, device=device)
                hits.append(block_loss(model, *batch(i), a)[1].cpu().numpy())
        model.train()
        hit = np.concatenate(hits).astype(np.float64)
        return hit.mean(0), float(1 + np.cumprod(hit, axis=1).sum(1).mean())

    acc, per_step = evaluate()
    print(f"held-out agreement per block position before: {np.round(acc, 3).tolist()}, "
          f"{per_step:.2f} tokens/step", flush=True)
    budget, start, step = minutes * 60.0, time.time(), 0
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 100) * max(0.05, 1 - frac)
        loss_sum = 0.0
        opt.zero_grad(set_to_none=True)
        for i in rng.integers(0, n - n_val, seqs):
            a = torch.from_numpy(rng.integers(0, T - B + 1, anchors)).to(device)
            loss, _ = block_loss(model, *batch(int(i)), a)
            (loss / seqs).backward()
            loss_sum += loss.item() / seqs
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0:
            print(f"step {step} loss {loss_sum:.3f} {time.time() - start:.0f}s", flush=True)
        step += 1
    acc, per_step = evaluate()
    print(f"held-out agreement per block position after {step} steps: {np.round(acc, 3).tolist()}, "
          f"{per_step:.2f} tokens/step", flush=True)
    return {"steps": step, "agreement": acc.tolist(), "tokens_per_step": per_step}
