"""Two tiny Llamas with a PLANTED interpolation optimum (``clmerge merge --tune`` tests, docs/tuning.md).

A and B have independent random weights (``initializer_range`` 0.3, so their predictions differ a lot) and one
tokenizer; the held-out text is sampled from ``(1 - W_STAR) A + W_STAR B``, so its perplexity under
``(1 - s) A + s B`` is lowest near ``s = W_STAR`` (its maximum-likelihood weight).
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from vocab_helpers import CORE, tiny_tokenizer

W_STAR = 0.3


def _random_lm(seed: int):
    import transformers as tf

    tok = tiny_tokenizer(CORE)
    cfg = tf.LlamaConfig(vocab_size=len(tok.get_vocab()), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3, bos_token_id=1,
                         eos_token_id=2, pad_token_id=None)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).eval(), tok


def _sample(model, tok, n_docs=40, length=30) -> list[str]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok.get_vocab()), (n_docs, 1), generator=g)
    with torch.no_grad():
        for _ in range(length):
            p = torch.softmax(model(input_ids=ids).logits[:, -1], -1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], 1)
    words = {i: w for w, i in tok.get_vocab().items()}
    return [" ".join(words[int(t)] for t in row) for row in ids]


def planted_pair(root: Path) -> tuple[Path, dict]:
    """``root/A``, ``root/B``, ``root/heldout.txt`` and ``root/recipe.yaml`` (task_arithmetic of base A and
    expert B); returns ``root`` and the recipe as a dict."""
    (a, tok), (b, _) = _random_lm(1), _random_lm(2)
    for name, m in (("A", a), ("B", b)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    mix, _ = _random_lm(1)
    sa, sb = a.state_dict(), b.state_dict()
    mix.load_state_dict({k: (1 - W_STAR) * sa[k] + W_STAR * sb[k] for k in sa})
    (root / "heldout.txt").write_text("\n\n".join(_sample(mix, tok)) + "\n")
    recipe = {"method": "task_arithmetic", "base": str(root / "A"), "models": [{"model": str(root / "B")}],
              "parameters": {"scaling": 1.0}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root, recipe
