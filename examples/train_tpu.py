#!/usr/bin/env python3
"""Trains a small MLP classifier on synthetic 2D spirals, on any PyTorch device.

Plain PyTorch: the only TPU-specific part is the device name. With torch_tpu
installed, "tpu" is a native device (served by tpud, found through
TPUD_SOCKET), so the same script runs on --device=cpu and --device=tpu and,
with the same --seed, prints the same losses.

    TPUD_SOCKET=/path/to/tpud.sock python examples/train_tpu.py --device tpu:1

Progress lines:  step 10/200 loss 0.6931 acc 0.52
Final line:      final step 200/200 loss ... acc ... eval_acc ... device tpu:0 time ...s
"""
import argparse
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:  # torch's backend autoload normally does this; importing makes it explicit
    import torch_tpu  # noqa: F401
except ImportError:
    pass


def make_spirals(n, classes, generator):
    """`n` points on `classes` interleaved noisy spiral arms, shuffled."""
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, per)
        theta = r * 3.5 * math.pi + 2 * math.pi * c / classes
        theta = theta + 0.15 * torch.randn(per, generator=generator)
        xs.append(torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1))
        ys.append(torch.full((per,), c, dtype=torch.long))
    x, y = torch.cat(xs), torch.cat(ys)
    perm = torch.randperm(x.shape[0], generator=generator)
    return x[perm], y[perm]


class MLP(nn.Module):
    def __init__(self, classes, width=64, depth=3):
        super().__init__()
        layers, d_in = [], 2
        for _ in range(depth):
            layers += [nn.Linear(d_in, width), nn.LayerNorm(width), nn.GELU()]
            d_in = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="tpu", help='torch device, e.g. "tpu", "tpu:1", "cpu"')
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)  # model init happens on CPU, then .to(device)
    data_gen = torch.Generator().manual_seed(args.seed)
    x, y = make_spirals(args.samples, args.classes, data_gen)
    n_train = int(0.8 * x.shape[0])
    train = TensorDataset(x[:n_train], y[:n_train])
    x_eval, y_eval = x[n_train:].to(device), y[n_train:].to(device)

    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed + 1),
                        pin_memory=(device.type == "tpu"))

    model = MLP(args.classes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    step = 0
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen = 0
    last_loss = last_acc = float("nan")
    while step < args.steps:
        for xb, yb in loader:
            xb = xb.to(device, non_blocking=True)
            yb = yb.to(device, non_blocking=True)
            model.train()
            logits = model(xb)
            loss = loss_fn(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            # Accumulate on the device; read back only when printing.
            loss_sum += loss.detach()
            correct += (logits.argmax(1) == yb).sum()
            seen += yb.shape[0]
            if step % args.log_every == 0 or step == args.steps:
                last_loss = loss_sum.item() / (seen // args.batch_size)  # mean over batches
                last_acc = correct.item() / seen
                print(f"step {step}/{args.steps} loss {last_loss:.4f} acc {last_acc:.2f}",
                      flush=True)
                loss_sum.zero_()
                correct.zero_()
                seen = 0
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        eval_acc = (model(x_eval).argmax(1) == y_eval).float().mean().item()
    elapsed = time.perf_counter() - start
    print(f"final step {step}/{args.steps} loss {last_loss:.4f} acc {last_acc:.2f} "
          f"eval_acc {eval_acc:.3f} device {device} time {elapsed:.1f}s", flush=True)


if __name__ == "__main__":
    main()
