"""The embedded default data set: a small E2E-like restaurant corpus and its BPE tokenizer.

The project cannot ship the E2E data (see ``../shared/data/README.md``), so the demo
makes its own. Meaning representations use the slot names and the ``MR||text`` line
format of the E2E files distributed with microsoft/LoRA (``name : X | Type : Y | ...``);
texts are realised from a few templates per slot, so a tiny GPT-2 learns the mapping
in a few hundred steps while beam search still has choices to make.

Everything is deterministic: the MRs and templates come from numpy's legacy
``RandomState`` (its stream is frozen across numpy versions) and the byte-level BPE
(``tokenizers``, ``<|endoftext|>`` as its only special token, id 0) is trained on the
training split; two runs write byte-identical files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .nlg import write_text_atomic
from .tokenizer import EOS_TOKEN

__all__ = ["SLOTS", "make_toy_dataset", "realise", "sample_mr", "train_toy_tokenizer"]

# slot -> values, in the E2E files' slot order.
SLOTS: dict[str, tuple[str, ...]] = {
    "name": (
        "The Eagle",
        "The Golden Lion",
        "Blue Harbour",
        "The Copper Kettle",
        "Green Garden",
        "The Old Mill",
        "Red Fox",
        "The Silver Spoon",
        "Sunrise",
        "The Stone Bridge",
        "Little Italy",
        "The Lantern",
    ),
    "Type": ("pub", "restaurant", "coffee shop"),
    "food": ("French", "English", "Italian", "Chinese", "Indian", "Japanese", "Fast food"),
    "price": ("cheap", "moderate", "high"),
    "customer rating": ("low", "average", "high"),
    "area": ("riverside", "city centre"),
    "family friendly": ("yes", "no"),
    "near": ("Burger King", "Cafe Rouge", "The Bakery", "City Hall", "Riverside Park", "The Cinema"),
}
_OPTIONAL = [s for s in SLOTS if s != "name"]
_AREA = {"riverside": "the riverside area", "city centre": "the city centre"}
_PRICE = {"cheap": "low", "moderate": "average", "high": "high"}
_SPLITS = {"train": (1500, 1), "valid": (100, 2), "test": (50, 3)}  # MRs, references per MR


def sample_mr(rng: np.random.RandomState) -> dict[str, str]:
    """Draw one MR: a name, ``Type`` with probability 0.8, each other slot with 0.5 (at least two)."""
    while True:
        mr = {"name": SLOTS["name"][rng.randint(len(SLOTS["name"]))]}
        for slot in _OPTIONAL:
            if rng.rand() < (0.8 if slot == "Type" else 0.5):
                mr[slot] = SLOTS[slot][rng.randint(len(SLOTS[slot]))]
        if len(mr) >= 3:
            return mr


def mr_text(mr: dict[str, str]) -> str:
    """E2E MR string, e.g. ``name : Red Fox | Type : pub | area : riverside``."""
    return " | ".join(f"{k} : {v}" for k, v in mr.items())


def realise(mr: dict[str, str], variant: tuple[int, ...]) -> str:
    """Text for ``mr`` with template choices ``variant`` = (intro 0-2, place 0-1, style 0-1)."""
    intro, place, style = variant
    name, kind = mr["name"], mr.get("Type", "place")
    food = mr.get("food")
    food_l = food.lower() if food == "Fast food" else food
    if intro == 0:
        head = f"{name} is a {kind}" + (f" serving {food_l} food" if food else "")
    elif intro == 1:
        head = f"{name} is a {food_l + ' ' if food else ''}{kind}"
    else:
        head = f"There is a {kind} called {name}" + (f" that serves {food_l} food" if food else "")
    where = []
    if "area" in mr:
        where.append(f"in {_AREA[mr['area']]}")
    if "near" in mr:
        where.append(f"near {mr['near']}")
    if place == 1:
        where.reverse()
    sents = [head + (" " + " ".join(where) if where else "") + "."]
    if "price" in mr:
        sents.append(f"It has a {mr['price']} price range." if style == 0 else f"Prices are {_PRICE[mr['price']]}.")
    if "customer rating" in mr:
        r = mr["customer rating"]
        sents.append(f"It has a {r} customer rating." if style == 0 else f"Customers give it a {r} rating.")
    if "family friendly" in mr:
        no = mr["family friendly"] == "no"
        sents.append(
            ("It is not family friendly." if no else "It is family friendly.")
            if style == 0
            else ("Children are not welcome." if no else "Children are welcome.")
        )
    return " ".join(sents)


def _texts(rng: np.random.RandomState, mr: dict[str, str], n: int) -> list[str]:
    """Up to ``n`` different realisations of ``mr``, drawn uniformly among the distinct ones."""
    distinct = list(dict.fromkeys(realise(mr, (i, p, s)) for i in range(3) for p in range(2) for s in range(2)))
    return [distinct[j] for j in rng.permutation(len(distinct))[:n]]


def train_toy_tokenizer(texts: list[str], vocab_size: int = 512):
    """Train a byte-level BPE on ``texts``; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def make_toy_dataset(out_dir: str | os.PathLike, seed: int = 0, vocab_size: int = 512) -> dict[str, Path]:
    """Write ``train.txt``, ``valid.txt``, ``test.txt`` (E2E ``MR||text`` lines) and ``tokenizer.json``.

    Splits hold 1500 / 100 / 50 distinct MRs with 1 / up to 2 / up to 3 references
    each (fewer only when the templates give a MR fewer distinct texts); a MR's
    references are consecutive lines, and no MR is in two splits.

    Args:
        out_dir: output folder (created).
        seed: seed of the MR and template draws.
        vocab_size: BPE vocabulary size, ``<|endoftext|>`` included.

    Returns:
        ``{"train", "valid", "test", "tokenizer"}`` -> paths; ``load_tokenizer(out_dir)``
        loads the tokenizer.
    """
    out_dir = Path(out_dir)
    rng = np.random.RandomState(seed)
    seen: set[str] = set()
    paths: dict[str, Path] = {}
    train_texts: list[str] = []
    for split, (n_mrs, n_refs) in _SPLITS.items():
        lines: list[str] = []
        n_done = 0
        while n_done < n_mrs:
            mr = sample_mr(rng)
            key = mr_text(mr)
            if key in seen:
                continue
            seen.add(key)
            n_done += 1
            for text in _texts(rng, mr, n_refs):
                lines.append(f"{key}||{text}")
                if split == "train":  # what the tokenizer will see: context, " " + completion
                    train_texts += [key, " " + text]
        paths[split] = out_dir / f"{split}.txt"
        write_text_atomic(paths[split], "".join(line + "\n" for line in lines))
    tok = train_toy_tokenizer(train_texts, vocab_size)
    paths["tokenizer"] = out_dir / "tokenizer.json"
    write_text_atomic(paths["tokenizer"], tok.to_str(pretty=True) + "\n")
    return paths
