"""The speculative methods specdec runs, each described once: what its `model` names, whether it drafts trees,
where suffix drafts run beside it, which function builds its proposer and (heads) which class its heads are and
how `specdec train-heads` trains them. Config validation (`config.SpeculativeConfig`), loading
(`speculative/drafters.py`), building (`speculative/build.py`), the heads' files, training and the bench read
these fields, never a method's name: adding a method is a module of its own, an entry here and its tests
(`tests/test_methods.py` scans the package for method-name comparisons outside this table and the parsers).

This table sits under `config`, as `architectures` does, and imports nothing of specdec: the builders, head
classes and losses it names live above it, so it names them as "module:attribute" and `resolve` imports them
where they are used. Example:

    >>> METHODS["eagle"].tree, METHODS["eagle"].model is Model.HEADS, METHODS["ngram"].suffix is Suffix.NEVER
    (True, True, True)
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Any


class Model(enum.Enum):
    """What a method's `model` names."""

    NONE = "none"  # no weights (n-grams, suffix tries)
    DRAFT_MODEL = "draft_model"  # a draft model, required
    HEADS = "heads"  # heads of this very method, trained on the target, required
    ANY = "any"  # a draft model or heads of any method; none: the heads shipped for the target, if any


class Suffix(enum.Enum):
    """Where suffix drafts run with a method (`SpeculativeConfig.suffix`, `with_suffix`)."""

    NEVER = "never"  # nowhere: `"suffix": true` is refused
    ALONE = "alone"  # the method is the suffix tries themselves
    ON = "on"  # beside its drafter unless `"suffix": false`
    OFF = "off"  # beside its drafter with `"suffix": true`
    # always beside its second drafter, per sequence and step whichever pays (`"suffix": false` refused)
    ALWAYS = "always"


@dataclass(frozen=True)
class Recipe:
    """How `specdec train-heads` trains a heads method (`specdec.training.train`)."""

    losses: str  # its losses ("module:function", `specdec.training.losses`)
    report_key: str  # the report's held-out top-1 agreement per drafted position
    num_heads: bool = False  # one head per drafted position (--num-heads)
    mlp: bool = False  # a decoder layer with an MLP (--intermediate-size)
    cls_weight: bool = False  # a token loss beside a feature loss (--cls-weight), EAGLE-1's losses
    # EAGLE-3 style: target layers fused into its feature (--feature-layers), then training-time test, soft
    # labels, and starting from trained heads of the same method (--init-from)
    feature_layers: bool = False


@dataclass(frozen=True)
class Method:
    name: str  # SpeculativeConfig.method, vLLM's spelling
    model: Model
    suffix: Suffix
    tree: bool = False  # drafts trees (`SpeculativeConfig.tree`)
    # builder(spec, inputs) -> Proposer ("module:function", `specdec.speculative.build.BuildInputs`); None: it
    # always drafts beside the suffix tries, which build_proposer builds itself
    builder: str | None = None
    heads_class: str | None = None  # Model.HEADS: the heads' module ("module:class", `specdec.heads.modules`)
    shipped_suffixes: tuple[str, ...] = ()  # Model.HEADS: shipped heads are TARGET-SUFFIX, best first
    training: Recipe | None = None  # Model.HEADS: how they are trained

    @property
    def needs_model(self) -> bool:
        return self.model in (Model.DRAFT_MODEL, Model.HEADS)

    @property
    def takes_draft_model(self) -> bool:
        """Whether its `model` may name a draft model."""
        return self.model in (Model.DRAFT_MODEL, Model.ANY)

    @property
    def takes_heads(self) -> bool:
        """Whether its `model` may name heads (or, with none named, take those shipped for the target)."""
        return self.model in (Model.HEADS, Model.ANY)

    @property
    def always_suffix(self) -> bool:
        """Whether it drafts from the suffix tries whatever the config says (alone or beside another drafter)."""
        return self.suffix in (Suffix.ALONE, Suffix.ALWAYS)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("auto", Model.ANY, Suffix.ALWAYS),
        Method("draft_model", Model.DRAFT_MODEL, Suffix.ON, builder="specdec.speculative.build:build_draft_model"),
        Method("ngram", Model.NONE, Suffix.NEVER, builder="specdec.speculative.build:build_ngram"),
        Method("suffix", Model.NONE, Suffix.ALONE, tree=True, builder="specdec.speculative.build:build_suffix"),
        Method("medusa", Model.HEADS, Suffix.OFF, tree=True, builder="specdec.speculative.build:build_medusa",
               heads_class="specdec.heads.modules:MedusaHeads", shipped_suffixes=("medusa",),
               training=Recipe("specdec.training.losses:medusa_losses", "held_out_top1_per_head", num_heads=True)),
        # the EAGLE-3 head drafts more than the EAGLE-1 one at every K measured: shipped first
        Method("eagle", Model.HEADS, Suffix.OFF, tree=True, builder="specdec.speculative.build:build_eagle",
               heads_class="specdec.heads.modules:EagleHead", shipped_suffixes=("eagle3", "eagle"),
               training=Recipe("specdec.training.losses:eagle_losses", "held_out_top1_per_depth", mlp=True,
                               cls_weight=True, feature_layers=True)),
    )
}
HEAD_METHODS = tuple(m.name for m in METHODS.values() if m.model is Model.HEADS)  # medusa, eagle: heads' kinds


def method(name: str) -> Method:
    """The record of method `name`; a clear error for a name specdec does not know."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown speculative method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def either(names: list[str] | tuple[str, ...], quote: bool = False) -> str:
    """Names for a message: ["medusa", "eagle", "suffix"] -> "medusa, eagle or suffix"."""
    names = [f'"{n}"' for n in names] if quote else list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def resolve(path: str) -> Any:
    """"module:attribute" -> that attribute, imported now (the table names what lives above it; see above)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
