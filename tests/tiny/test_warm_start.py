"""`mmalign.tiny.warm_start.fit` against the loop it replaced, written out by hand: same parameters bit for bit
(with a schedule and clipping), and the early-stop checks at the steps the builders expect."""

from __future__ import annotations

import torch

from mmalign.tiny.warm_start import fit


def _problem(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g)
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1), x, y


def test_fit_equals_the_hand_written_loop() -> None:
    def run(use_fit: bool) -> tuple[list[float], torch.Tensor]:
        model, x, y = _problem()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        g = torch.Generator().manual_seed(1)

        def loss_at(_: int) -> torch.Tensor:
            idx = torch.randint(0, 64, (8,), generator=g)
            return (model(x[idx]) - y[idx]).pow(2).mean()

        if use_fit:
            losses = fit(opt, 20, loss_at, "test", sched=sched, clip_norm=0.5, progress=False)
        else:
            losses = []
            for step in range(20):
                loss = loss_at(step)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                losses.append(float(loss))
        return losses, torch.cat([p.detach().flatten() for p in model.parameters()])

    (l1, p1), (l2, p2) = run(True), run(False)
    assert l1 == l2 and torch.equal(p1, p2)
    assert l1[-1] < l1[0]


def test_early_stop_checks() -> None:
    model, x, y = _problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[tuple[int, bool]] = []

    def stop(done: int) -> bool:
        seen.append((done, torch.is_grad_enabled()))
        return done >= 6

    losses = fit(
        opt, 10, lambda _: (model(x) - y).pow(2).mean(), "t", stop=stop, check_every=3, progress=False
    )
    assert len(losses) == 6 and seen == [(3, False), (6, False)]  # stops after the check that says so
    seen.clear()
    assert (
        len(
            fit(
                opt,
                6,
                lambda _: (model(x) - y).pow(2).mean(),
                "t",
                stop=lambda d: bool(seen.append((d, 0))),
                check_every=3,
                progress=False,
            )
        )
        == 6
    )
    assert [d for d, _ in seen] == [3]  # never at the last step unless asked
    seen.clear()
    fit(
        opt,
        6,
        lambda _: (model(x) - y).pow(2).mean(),
        "t",
        stop=lambda d: bool(seen.append((d, 0))),
        check_every=3,
        check_at_end=True,
        progress=False,
    )
    assert [d for d, _ in seen] == [3, 6]
