"""The tuning examples of docs/tuning.md: a grid over task_arithmetic's scaling on the planted pair of the tests
(tests/tune_helpers.py: two tiny Llamas A, B; held-out text sampled from 0.7 A + 0.3 B), scored by

1. accuracy on 40 multiple-choice questions whose answer is the mixture's most likely next word (three less
   likely words as distractors), the range [0, 1] in 11 points;
2. held-out perplexity with the range [0, 0.2] in 3 points: the best value sits on the top edge, so the grid
   warns and extends past it (extend: 2).

Writes benchmarks/merging/tune_task_metrics.md. Command:
``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/merging/tune_task_metrics.py``
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from tune_helpers import W_STAR, planted_pair  # noqa: E402

from clmerge.merging.lm_eval import load_causal_lm  # noqa: E402
from clmerge.merging.recipes import load_recipe  # noqa: E402
from clmerge.merging.task_eval import EvalSpec  # noqa: E402
from clmerge.merging.tune import Dimension, TuneSpec, load_tune_spec, tune  # noqa: E402
from clmerge.sweep.executors import LocalExecutor  # noqa: E402


def questions(root: Path, n: int = 40) -> list[dict]:
    a, tok = load_causal_lm(root / "A")
    b, _ = load_causal_lm(root / "B")
    sb = b.state_dict()
    a.load_state_dict({k: (1 - W_STAR) * v + W_STAR * sb[k] for k, v in a.state_dict().items()})
    g = torch.Generator().manual_seed(5)
    words = sorted(w for w in tok.get_vocab() if w.startswith("w"))  # (get_vocab's order varies)
    out = []
    for _ in range(n):
        q = " ".join(words[int(i)] for i in torch.randint(len(words), (5,), generator=g))
        with torch.no_grad():
            logits = a(input_ids=torch.tensor([tok(q)["input_ids"]])).logits[0, -1]
        ranked = [t for t in (tok.convert_ids_to_tokens(int(i)) for i in logits.argsort(descending=True))
                  if t.startswith("w")]
        out.append({"question": q, "choices": [ranked[5], ranked[0], ranked[9], ranked[15]], "answer": 1})
    return out


def main() -> None:
    torch.set_num_threads(1)
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root, data = planted_pair(Path(tmp))
        recipe = load_recipe("", data)
        (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in questions(root)))
        (root / "tune.yaml").write_text(yaml.safe_dump({"points": 11, "space": {"parameters.scaling": [0.0, 1.0]},
                                                       "eval": {"data": "mc.jsonl", "batch_size": 16}}))
        acc_log: list[str] = []
        acc = tune(recipe, load_tune_spec(root / "tune.yaml"), root / "out_acc", executor=LocalExecutor(0),
                   log=acc_log.append)
        spec = TuneSpec(space=[Dimension("parameters.scaling", 0.0, 0.2)],
                        eval=EvalSpec(str(root / "heldout.txt"), max_length=64, batch_size=8), points=3)
        edge_log: list[str] = []
        edge = tune(recipe, spec, root / "out_edge", executor=LocalExecutor(0), log=edge_log.append)
    trials = [ln for ln in acc_log if ln.startswith("trial ")]
    values = [ln.split("{'parameters.scaling': ")[1].split("}")[0] for ln in trials]
    accs = [ln.split(" acc ")[1].split()[0] for ln in trials]
    lines += ["# Tuned merges on task metrics and at the edge of a range", "",
              "Planted pair of tests/tune_helpers.py (two tiny Llamas; held-out text from 0.7 A + 0.3 B), recipe "
              "task_arithmetic of base A and expert B (`A + s (B - A)`), grid over `parameters.scaling`.", "",
              "## Multiple-choice accuracy (40 questions answered by the mixture), scaling [0, 1], 11 points", "",
              "| scaling | " + " | ".join(values) + " |", "|---|" + "---|" * len(values),
              "| acc (%) | " + " | ".join(f"{float(a):.1f}" for a in accs) + " |", "",
              f"Best: {acc['best']} acc {acc['metric']:.1f} of {acc['trials']} trials.", "",
              "## Perplexity, scaling [0, 0.2], 3 points (extend: 2)", "", "```",
              *[ln for ln in edge_log if ln.startswith(("trial ", "warning"))], "```", "",
              f"Best: {edge['best']} perplexity {edge['metric']:.4f} of {edge['trials']} trials; at the edge: "
              f"{edge['at_edge'] or 'none'}.", "",
              "Command: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/merging/tune_task_metrics.py` (torch "
              f"{torch.__version__}, {platform.machine()} CPU, one thread; deterministic).", ""]
    (Path(__file__).with_suffix(".md")).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
