"""The torch demo's training program: a gated-MLP model whose training step and eval are
torch.compile'd (Inductor, its C++ backend on CPU), as a team's would be.

    python train_torch.py --steps 1       # train; prints one JSON line of timings and counters
    warm.py targets train_torch:warm      # the same compiled step and eval on example inputs

The JSON line gives the seconds of the first step (the compile it pays) and torch's own
cache counters (FX graph cache, AOTAutograd cache), so a test reads what the process saw."""

from __future__ import annotations

import argparse
import json
import time

T0 = time.monotonic()

import torch  # noqa: E402 - the import is timed
from torch import nn  # noqa: E402

WIDTH, DEPTH, BATCH = 64, 6, 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.gate = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build() -> tuple[nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return model, opt, torch.compile(step), torch.compile(model)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)


def counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters as c
    return {"inductor": {k: v for k, v in c["inductor"].items() if "cache" in k},
            "aotAutograd": {k: v for k, v in c["aot_autograd"].items() if "cache" in k}}


def warm() -> None:
    """targets mode: the compiled step and eval run once on example inputs."""
    model, opt, step, evaluate = build()
    x, y = batch(0)
    step(x, y)
    opt.step()
    with torch.no_grad():
        evaluate(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    t_import = time.monotonic() - T0
    model, opt, step, evaluate = build()
    seconds = []
    first_done = 0.0
    for i in range(args.steps):
        x, y = batch(i)
        t = time.monotonic()
        loss = step(x, y)
        opt.step()
        seconds.append(time.monotonic() - t)
        if i == 0:
            first_done = time.time()  # wall clock: a benchmark compares it with the pod's creation
    t = time.monotonic()
    with torch.no_grad():
        evaluate(batch(0)[0])
    eval_seconds = time.monotonic() - t
    print(json.dumps({"importSeconds": round(t_import, 3), "firstStepSeconds": round(seconds[0], 3),
                      "firstStepDoneAt": round(first_done, 3),
                      "stepSeconds": [round(s, 3) for s in seconds], "evalSeconds": round(eval_seconds, 3),
                      "loss": round(float(loss), 6), "counters": counters()}), flush=True)


if __name__ == "__main__":
    main()
