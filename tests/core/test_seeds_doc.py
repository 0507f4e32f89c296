"""docs/seeds.md: one row per seed paper, every registry name it gives is registered, the counts add up."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "seeds.md"
SEED_SIZES = {"001": 58, "002": 71}  # papers in each seed list
DUPLICATES = 7  # papers in both lists
STATUSES = ("has", "partial", "missing", "not applicable")
COUNT_KEYS = {"has": "has", "partial": "partial", "missing": "missing", "not applicable": "not applicable"}


def registries() -> dict[str, list[str]]:
    """kind -> registered names, for every kind the document may name."""
    import pipelines
    import rewards.base
    from mmalign.algorithms import advantages, filters, flow_objectives, losses, reward_transforms, sde
    from mmalign.data import prompt_samplers, rollout_loops

    return {
        "estimator": advantages.names(),
        "loss": losses.names(),
        "aggregation": losses.aggregation_names(),
        "kl": losses.kl_names(),
        "filter": filters.names(),
        "sampler": prompt_samplers.names(),
        "transform": reward_transforms.names(),
        "reward": rewards.base.names(),
        "pipeline": pipelines.names(),
        "loop": rollout_loops.names(),
        "sde": sde.names(),
        "objective": flow_objectives.names(),
    }


def rows() -> list[list[str]]:
    out = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\| 00[12]#", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            assert len(cells) == 5, line
            out.append(cells)
    return out


def test_one_row_per_paper_of_both_seed_lists():
    seen: Counter[str] = Counter()
    table = rows()
    for seed, *_ in table:
        for entry in (s.strip() for s in seed.split(",")):
            assert re.fullmatch(r"00[12]#\d+", entry), entry
            seen[entry] += 1
    want = {f"{s}#{i}" for s, n in SEED_SIZES.items() for i in range(n)}
    assert set(seen) == want, (sorted(want - set(seen)), sorted(set(seen) - want))
    assert max(seen.values()) == 1
    assert len(table) == sum(SEED_SIZES.values()) - DUPLICATES
    assert sum("," in seed for seed, *_ in table) == DUPLICATES


def test_statuses_and_the_counts_line():
    table = rows()
    counts = Counter(status for _, _, status, _, _ in table)
    assert set(counts) <= set(STATUSES), counts
    text = DOC.read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("**Counts:"))
    for status in STATUSES:
        m = re.search(rf"{status} (\d+)", line)
        assert m, (status, line)
        assert int(m.group(1)) == counts[status], (status, counts)
    assert f"**{len(table)}\npapers**" in text or f"**{len(table)} papers**" in text


def test_every_registry_name_in_the_mmalign_column_is_registered():
    known = registries()
    named = 0
    for seed, _, status, mmalign, use in rows():
        for token in re.findall(r"`([^`]*)`", mmalign):
            kind, sep, name = token.partition(":")
            assert sep and kind in known, f"{seed}: {token!r} is not kind:name with a known kind"
            assert name in known[kind], (
                f"{seed}: {kind} {name!r} is not registered ({', '.join(known[kind])})"
            )
            named += 1
        leftover = re.sub(r"`[^`]*`", "", mmalign).replace("†", "").replace(",", "").strip()
        assert not leftover, f"{seed}: the mmalign column holds only `kind:name` entries, got {leftover!r}"
        assert use, f"{seed}: the last column says how to use it or why not"
        if status == "has":
            assert mmalign or "`" in use, f"{seed}: a 'has' row names an entry or a config"
    assert named > 50


@pytest.mark.parametrize("kind", ["estimator", "transform", "loss", "filter", "sampler"])
def test_the_new_core_entries_are_all_mapped_to_a_paper(kind):
    """Every estimator / transform / loss / filter / sampler registered in the core appears in the document,
    except the classic baselines that predate the seed lists."""
    classics = {
        "grpo",
        "dr_grpo",
        "reinforce_pp",
        "pass_at_k",
        "none",
        "uniform",
        "cispo",
        "dual_clip",
        "gspo",
        "sapo",
    }
    classics |= {"range"}
    text = DOC.read_text(encoding="utf-8")
    for name in registries()[kind]:
        if name in classics:
            continue
        assert f"`{kind}:{name}`" in text, f"{kind} {name!r} is not mentioned in docs/seeds.md"
