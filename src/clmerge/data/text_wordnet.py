"""``wordnet_supersense``: WordNet glosses labelled by their lexicographer file (supersense).

Read from the standard WordNet database files ``data.noun`` / ``data.verb`` (Debian ``wordnet-base`` installs
them under ``/usr/share/wordnet``; an NLTK ``wordnet`` corpus folder holds the same files). A data line is

    synset_offset lex_filenum ss_type w_cnt word lex_id [word lex_id...] p_cnt [ptr...] [frames...] | gloss

(WordNet's wndb(5) manual page); the lexicographer file number (2nd field, two decimal digits) is the label, its
name comes from the ``lexnames`` file when present, else from the fixed table below (lexnames(5)). Lines that
begin with two spaces are the licence header.

Classes: the 26 noun and 15 verb lexicographer files are 41 supersenses. The default drops ``noun.Tops`` (51
synsets): it holds the unique beginners of the noun hierarchies (``entity``, ``animal``, ``plant``, ...), each of
which belongs in meaning to another file's field, so its label is not a semantic category. That leaves 40
classes (10 tasks x 4), the setting of the text benchmarks. ``noun.motive`` (42 synsets) and ``verb.weather`` (81) stay: the
split below keeps a quarter of any small class for testing.

Text of an item: ``"lemma: definition"`` (the synset's first lemma, underscores as spaces, then the gloss up to
its first quoted example); ``examples: true`` keeps the examples, ``lemma: false`` drops the lemma.

Split (deterministic, independent of the scenario seed): per class, the synsets in file order are permuted with
``numpy.random.default_rng([split_seed, lex_filenum])``; the first ``min(max_test, n // 4)`` are the test set,
the next ``min(max_train, n - n_test)`` the training set.

Licence: WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved. Distributed under the WordNet
3.0 licence (permission to use, copy, modify and distribute for any purpose without fee, keeping the copyright
notice; provided "as is"): see docs/text.md and the data package's copyright file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..utils.inpaths import read_text as read_input_text
from ..utils.io import sha256_file
from .base import DataSplits, register_dataset
from .text_tokens import TokenCache, TokenData, cache_dir_for, load_tokenizer, tokenize_texts, tokenizer_digest

__all__ = ["LEXNAMES", "DEFAULT_CLASSES", "Synset", "parse_data_line", "read_data_file", "find_wordnet_dir",
           "wordnet_supersense", "WORDNET_LICENCE"]

# lexnames(5): lexicographer file number -> name (WordNet 3.0)
LEXNAMES = (
    ["adj.all", "adj.pert", "adv.all", "noun.Tops"]
    + [f"noun.{n}" for n in ("act", "animal", "artifact", "attribute", "body", "cognition", "communication",
                             "event", "feeling", "food", "group", "location", "motive", "object", "person",
                             "phenomenon", "plant", "possession", "process", "quantity", "relation", "shape",
                             "state", "substance", "time")]
    + [f"verb.{n}" for n in ("body", "change", "cognition", "communication", "competition", "consumption",
                             "contact", "creation", "emotion", "motion", "perception", "possession", "social",
                             "stative", "weather")]
    + ["adj.ppl"]
)
POS_FILES = {"noun": "data.noun", "verb": "data.verb"}
DEFAULT_CLASSES = [n for n in LEXNAMES if n.split(".")[0] in POS_FILES and n != "noun.Tops"]
WORDNET_LICENCE = ("WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved. WordNet 3.0 licence: "
                   "use, copy, modify and distribute for any purpose without fee, keeping this notice; "
                   "provided AS IS without warranty")
DEBIAN_DIR = Path("/usr/share/wordnet")  # Debian / Ubuntu package wordnet-base
INSTALL_HINT = ("install it with `apt-get install wordnet-base` (files in /usr/share/wordnet), or "
                "`python -m nltk.downloader wordnet` (~/nltk_data/corpora/wordnet), or set scenario.data_root")


@dataclass(frozen=True)
class Synset:
    offset: int
    lexfile: int
    lemmas: tuple[str, ...]
    gloss: str


def parse_data_line(line: str, *, where: str = "") -> Synset | None:
    """One ``data.pos`` line -> :class:`Synset`; ``None`` for licence-header or blank lines.

    Raises ``ValueError`` naming ``where`` (file:line) for a malformed line.
    """
    if not line.strip() or line.startswith("  "):
        return None
    head, bar, gloss = line.partition(" | ")
    fields = head.split()
    try:
        offset, lexfile, n_words = int(fields[0]), int(fields[1]), int(fields[3], 16)  # w_cnt is hexadecimal
        lemmas = tuple(fields[4 + 2 * i] for i in range(n_words))
    except (IndexError, ValueError):
        raise ValueError(f"{where}: not a WordNet data line: {line[:60]!r}") from None
    if not bar or n_words < 1 or not 0 <= lexfile < len(LEXNAMES):
        raise ValueError(f"{where}: not a WordNet data line: {line[:60]!r}")
    return Synset(offset, lexfile, lemmas, gloss.strip())


def read_data_file(path: Path) -> list[Synset]:
    out = []
    text = read_input_text(path, kind="data", errors="replace")  # a regular file (utils.inpaths)
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # the lines text mode gives
    if lines and lines[-1] == "":
        lines.pop()
    for i, line in enumerate(lines, 1):
        s = parse_data_line(line, where=f"{path}:{i}")
        if s is not None:
            out.append(s)
    return out


def item_text(s: Synset, *, lemma: bool = True, examples: bool = False) -> str:
    """``"lemma: definition"``: the gloss up to its first quoted example unless ``examples``."""
    gloss = s.gloss if examples else s.gloss.split('; "')[0]
    gloss = gloss.strip().rstrip(";").strip()
    return f"{_lemma_text(s.lemmas[0])}: {gloss}" if lemma else gloss


def _lemma_text(word: str) -> str:
    word = word.split("(")[0]  # adjective markers such as "(a)" only occur in data.adj, kept safe here
    return word.replace("_", " ")


def _candidate_dirs(data_root: str | None) -> list[Path]:
    dirs: list[Path] = []
    if data_root:
        dirs += [Path(data_root), Path(data_root) / "wordnet", Path(data_root) / "dict"]
    if os.environ.get("CLMERGE_DATA"):
        dirs.append(Path(os.environ["CLMERGE_DATA"]) / "wordnet")
    dirs.append(DEBIAN_DIR)
    nltk = [p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p] + [str(Path.home() / "nltk_data")]
    dirs += [Path(p) / "corpora" / "wordnet" for p in nltk]
    return dirs


def find_wordnet_dir(data_root: str | None, files: list[str]) -> Path:
    """The first folder holding every one of ``files``: data_root (or its wordnet/, dict/), $CLMERGE_DATA/wordnet,
    /usr/share/wordnet, then NLTK data folders ($NLTK_DATA, ~/nltk_data) under corpora/wordnet."""
    dirs = _candidate_dirs(data_root)
    for d in dirs:
        if all((d / f).is_file() for f in files):
            return d
    raise InputError(f"wordnet_supersense: {' and '.join(files)} not found in {', '.join(map(str, dirs))}; "
                     f"{INSTALL_HINT}")


def _lexnames(folder: Path) -> list[str]:
    """Names from ``<folder>/lexnames`` (``NN<tab>name<tab>syntactic category``) when present, else LEXNAMES."""
    f = folder / "lexnames"
    if not f.is_file():
        return list(LEXNAMES)
    names = list(LEXNAMES)
    for line in read_input_text(f, kind="text").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < len(names):
            names[int(parts[0])] = parts[1]
    return names


def _select_classes(classes: list[str] | None, pos: list[str], names: list[str]) -> list[int]:
    """Lexicographer file numbers of the chosen classes, in the given (or table) order."""
    if classes is None:
        classes = [n for n in DEFAULT_CLASSES if n.split(".")[0] in pos]
    unknown = [c for c in classes if c not in names or c.split(".")[0] not in pos]
    if unknown:
        raise ValueError(f"scenario.options.classes: {unknown} are not {'/'.join(pos)} lexicographer files "
                         f"(e.g. {', '.join(DEFAULT_CLASSES[:3])})")
    if len(set(classes)) != len(classes):
        raise ValueError("scenario.options.classes: a class is listed twice")
    return [names.index(c) for c in classes]


def split_class(n: int, *, split_seed: int, lexfile: int, max_train: int,
                max_test: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train positions, test positions)`` within one class of ``n`` synsets (see the module docstring)."""
    perm = np.random.default_rng([split_seed, lexfile]).permutation(n)
    n_test = min(max_test, n // 4)
    n_train = min(max_train, n - n_test)
    return perm[n_test : n_test + n_train], perm[:n_test]


def _texts_and_labels(folder: Path, pos: list[str], lexfiles: list[int], o: dict) -> dict[str, list]:
    """Texts and class indices of both splits."""
    by_class: dict[int, list[Synset]] = {lf: [] for lf in lexfiles}
    for p in pos:
        for s in read_data_file(folder / POS_FILES[p]):
            if s.lexfile in by_class:
                by_class[s.lexfile].append(s)
    out: dict[str, list] = {"train_text": [], "train_y": [], "test_text": [], "test_y": []}
    for label, lf in enumerate(lexfiles):
        items = by_class[lf]
        if not items:
            raise InputError(f"wordnet_supersense: class {LEXNAMES[lf]} has no synsets in {folder}")
        tr, te = split_class(len(items), split_seed=o["split_seed"], lexfile=lf, max_train=o["max_train_per_class"],
                             max_test=o["max_test_per_class"])
        for split, pos_idx in (("train", tr), ("test", te)):
            out[f"{split}_text"] += [item_text(items[i], lemma=o["lemma"], examples=o["examples"]) for i in pos_idx]
            out[f"{split}_y"] += [label] * len(pos_idx)
    return out


def _tokenised(folder: Path, pos: list[str], lexfiles: list[int], opts: dict, tok, max_length: int) -> dict:
    raw = _texts_and_labels(folder, pos, lexfiles, opts)
    return {f"{s}_{k}": v for s in ("train", "test")
            for k, v in (("x", tokenize_texts(tok, raw[f"{s}_text"], max_length)),
                         ("y", np.asarray(raw[f"{s}_y"], dtype=np.int64)))}


def _cached_arrays(store: TokenCache | None, build) -> tuple[dict[str, np.ndarray], bool]:
    """``(arrays, cache hit)``: from ``store`` when it holds them, else ``build()`` (then saved)."""
    arrays = store.load() if store is not None else None
    if arrays is not None:
        return arrays, True
    arrays = build()
    if store is not None:
        store.save(arrays)
    return arrays, False


@register_dataset("wordnet_supersense", "WordNet 3.0 glosses labelled by lexicographer file (40 noun+verb "
                  "supersenses; apt-get install wordnet-base), tokenised for a text backbone")
def wordnet_supersense(*, data_root: str | None = None, pos: list[str] | None = None, classes: list[str] | None = None,
                       max_train_per_class: int = 300, max_test_per_class: int = 100, split_seed: int = 0,
                       lemma: bool = True, examples: bool = False, tokenizer: str = "minilm-l6",
                       max_length: int = 64, cache_dir: str | None = None, cache: bool = True, **_) -> DataSplits:
    pos = list(pos or ["noun", "verb"])
    if not set(pos) <= set(POS_FILES):
        raise ValueError(f"scenario.options.pos: {pos} must be among {', '.join(POS_FILES)}")
    if max_length < 2 or max_train_per_class < 1 or max_test_per_class < 1:
        raise ValueError("scenario.options: max_length must be >= 2 and max_*_per_class >= 1")
    files = [POS_FILES[p] for p in pos]
    folder = find_wordnet_dir(data_root, files)
    names = _lexnames(folder)
    lexfiles = _select_classes(classes, pos, names)
    file_sha = {f: sha256_file(folder / f) for f in files}
    tok = load_tokenizer(tokenizer)
    opts = {"pos": pos, "lexfiles": lexfiles, "max_train_per_class": max_train_per_class,
            "max_test_per_class": max_test_per_class, "split_seed": split_seed, "lemma": lemma, "examples": examples}
    key = {"source": "wordnet_supersense", "files": file_sha, "options": opts, "tokenizer": tokenizer_digest(tok),
           "max_length": max_length}
    store = TokenCache(cache_dir_for(cache_dir, data_root), "wordnet_supersense", key)
    arrays, hit = _cached_arrays(store if cache else None, lambda: _tokenised(folder, pos, lexfiles, opts, tok,
                                                                             max_length))
    class_names = [names[lf] for lf in lexfiles]
    fingerprint = {"source": "wordnet", "folder": str(folder), "sha256": file_sha, **opts, "classes": class_names,
                   "tokenizer": tokenizer, "tokenizer_sha256": key["tokenizer"], "max_length": max_length,
                   "n_train": len(arrays["train_y"]), "n_test": len(arrays["test_y"]), "cache_key": store.digest,
                   "cache": str(store.path) if cache else None, "cache_hit": hit, "licence": WORDNET_LICENCE}
    return DataSplits(
        train=TokenData(torch.from_numpy(arrays["train_x"]), arrays["train_y"], name="wordnet_supersense/train"),
        test=TokenData(torch.from_numpy(arrays["test_x"]), arrays["test_y"], name="wordnet_supersense/test"),
        class_names=class_names, fingerprint=fingerprint,
    )
