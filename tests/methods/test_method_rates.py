"""Every method trains at a rate of its own: on the embedded default (class-incremental digits, 5 tasks, the
shipped ViT) with only ``method.name`` switched, each method clearly beats chance.

Before methods owned their rate, the ones that fine-tune the whole backbone (finetune, ewc, l2, gpm, stl,
magmax) collapsed at the optim section's 5e-3 (docs/threads.md, "Learning rates"). The reduced cost is one
epoch per task instead of five and a smaller test set, at the SAME rate (the method's ``optim_defaults``):
the rate is what is under test."""

from __future__ import annotations

import json

import pytest

from clmerge.config import load_config
from clmerge.engine.run import run_experiment
from clmerge.methods import METHODS

# Measured here and not resolved: L2P at its grid rate (1e-3, selected on split_mnist5k with five epochs per
# task) stays at chance on this reduced default (one epoch per task: CIL 9.8, AAA 32.3). strict: a pass is news.
KNOWN = {"l2p": "L2P at 1e-3 and one epoch per task stays at chance here (CIL 9.8, AAA 32.3); unresolved"}
NAMES = [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n])) if n in KNOWN else n
         for n in sorted(METHODS)]
CHANCE_CIL = 100 / 10  # 10 digits
# average anytime accuracy of guessing: after task t (1-based) there are 2t classes to choose from
CHANCE_AAA = sum(100 / (2 * t) for t in range(1, 6)) / 5  # 22.8
REDUCED = ["train.epochs=1", "scenario.test_per_class=50", "run.progress=false", "run.report=false",
           "run.threads=1"]


def _default_run(name: str, out) -> dict:
    cfg = load_config(None, [f"method.name={name}", *REDUCED])
    assert cfg.optim.lr == METHODS[name].optim_defaults.get("lr", cfg.optim.lr)  # the method's own rate
    run_experiment(cfg, out)
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_method_beats_chance_on_the_embedded_default(name, tmp_path):
    """Average anytime accuracy above 1.6 x chance (each task learned as it comes) and final CIL accuracy above
    1.5 x chance. At 5e-3 the whole-backbone methods collapsed to AAA 26.8-32.3 and CIL 11.6-15.3 on the full
    default (docs/threads.md, "Learning rates"). At their own rates and one epoch per task, the methods that
    only forget (they keep about the last task; l2, stl, magmax) measured AAA 38.2-41.9 and CIL 17.2-19.8, so final
    CIL above twice chance would test forgetting, not the rate."""
    m = _default_run(name, tmp_path / "run")
    assert m["aaa"] > 1.6 * CHANCE_AAA and m["acc"] > 1.5 * CHANCE_CIL, (name, m["acc"], m["aaa"])
