"""The speculative methods' registry (`specdec.methods`): one record per method, which config validation, loading,
building, training and the bench read. Nothing else in the package compares a method's name: a new method is a
module, an entry in the registry and its tests."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import specdec
from specdec import cli
from specdec.bench.methods import KINDS, SPELLINGS, parse_method, shipped_heads_name
from specdec.config import SpeculativeConfig
from specdec.heads.modules import HEAD_METHODS, head_class
from specdec.methods import METHODS, Model, Recipe, Suffix, either, method, resolve

ROOT = Path(specdec.__file__).parent
# where a method's name may be compared: the registry, and the parsers that read names from people
PARSERS = {"methods.py", "cli.py", "llm_args.py"}
# "auto" also names settings that are not methods (quantization, dtypes, K/V format, generation config, tool
# choice): a comparison with "auto" counts only where the other side speaks of a method. Names that mean
# something else in a file: resolve_quantization calls its quantization `method`; `:suffix` is an option of the
# bench's `--methods` entries (a draft model's suffix drafts)
OTHER_MEANINGS = {"models/quant.py": {"auto"}, "bench/methods.py": {"suffix"}}


def method_name_comparisons(root: Path) -> list[str]:
    """`path:line: source` of every comparison (==, !=, in, not in) of a method's name as a string literal
    (alone, or in a tuple, list or set of literals), outside `PARSERS`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where in PARSERS:
            continue
        tree = ast.parse(path.read_text(), where)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                others = " ".join(ast.unparse(o) for j, o in enumerate(operands) if j != i)
                for name in _literals(operand) & set(METHODS):
                    if (name == "auto" and "method" not in others) or name in OTHER_MEANINGS.get(where, ()):
                        continue
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def _literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_no_method_name_comparisons_outside_the_registry():
    assert method_name_comparisons(ROOT) == []


def test_the_scan_catches_what_it_forbids(tmp_path):
    """A copy of the package with the comparisons the registry replaced: each caught; "auto" of a quantization
    or of a setting that is not a method is not a method."""
    fake = tmp_path / "specdec"
    (fake / "speculative").mkdir(parents=True)
    (fake / "models").mkdir()
    (fake / "speculative" / "bad.py").write_text(
        "def f(spec, cfg, d, kind):\n"
        "    if spec.method == 'medusa': pass\n"
        "    if cfg.method in ('draft_model', 'eagle'): pass\n"
        "    if d.get('method') != 'auto': pass\n"
        "    if 'ngram' == kind: pass\n"
        "    if kind not in ['suffix']: pass\n"
        "    if spec.kv_format == 'auto': pass\n")
    (fake / "models" / "quant.py").write_text("def g(method):\n    return method == 'auto'\n")
    (fake / "cli.py").write_text("def h(args):\n    return args.method == 'eagle'\n")
    assert [line.split(":")[1] for line in method_name_comparisons(fake)] == ["2", "3", "4", "5", "6"]


def test_every_method_has_one_complete_record():
    """Each record's fields agree with one another; builders, head classes and losses resolve, and each lives
    in the layer that calls it."""
    assert list(METHODS) == ["auto", "draft_model", "ngram", "suffix", "medusa", "eagle"]
    for name, record in METHODS.items():
        assert record.name == name and method(name) is record
        # a builder, unless it drafts only beside the suffix tries (build_proposer builds those itself)
        assert (record.builder is None) == (record.suffix is Suffix.ALWAYS)
        if record.builder is not None:
            assert record.builder.startswith("specdec.speculative.") and callable(resolve(record.builder))
            assert list(inspect.signature(resolve(record.builder)).parameters) == ["spec", "inputs"]
        heads = record.model is Model.HEADS
        assert (record.heads_class is not None) == heads == bool(record.shipped_suffixes)
        assert (record.training is not None) == heads
        if heads:
            assert record.heads_class.startswith("specdec.heads.") and head_class(name) is resolve(record.heads_class)
            assert record.training.losses.startswith("specdec.training.") and callable(resolve(record.training.losses))
        assert record.needs_model == (record.model in (Model.DRAFT_MODEL, Model.HEADS))
    assert HEAD_METHODS == ("medusa", "eagle")
    with pytest.raises(ValueError, match="unknown speculative method 'typo'; choose one of auto, draft_model"):
        method("typo")
    assert either(["medusa", "eagle", "suffix"]) == "medusa, eagle or suffix" and either(["a"], quote=True) == '"a"'


def test_the_parsers_offer_every_method():
    """The bench's `--methods` names every method (its spelling, or the method's own); train-heads offers every
    method with a training recipe; the config accepts every name in the registry and no other."""
    assert {SPELLINGS.get(kind, kind) for kind in KINDS if kind != "plain"} == set(METHODS)
    train = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["train-heads"]._actions
                 if a.dest == "method")
    assert train.choices == [name for name, record in METHODS.items() if isinstance(record.training, Recipe)]
    for name, record in METHODS.items():
        SpeculativeConfig(method=name, model="m" if record.needs_model else None)
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="medusa2", model="m")


@pytest.mark.parametrize("name", list(METHODS))
def test_the_config_reads_the_record(name):
    """Validation and the suffix properties follow the record's fields, for every method: needs a model,
    draws trees, where suffix drafts run."""
    record = METHODS[name]
    model = "m" if record.needs_model else None
    if record.needs_model:
        with pytest.raises(ValueError, match="needs a 'model'"):
            SpeculativeConfig(method=name)
    spec = SpeculativeConfig(method=name, model=model)
    assert spec.record is record
    assert spec.with_suffix == (record.suffix in (Suffix.ALWAYS, Suffix.ON))
    assert spec.uses_suffix == (record.suffix in (Suffix.ALWAYS, Suffix.ON, Suffix.ALONE))
    for suffix in (True, False):
        refused = (record.suffix is Suffix.NEVER and suffix) or (record.suffix is Suffix.ALWAYS and not suffix)
        if refused:
            with pytest.raises(ValueError, match="does not apply"):
                SpeculativeConfig(method=name, model=model, suffix=suffix)
        else:
            beside = SpeculativeConfig(method=name, model=model, suffix=suffix).with_suffix
            assert beside == (record.suffix is Suffix.ALWAYS or (suffix and record.suffix in (Suffix.ON, Suffix.OFF)))
    chains_only = record.suffix in (Suffix.ALWAYS, Suffix.ON)  # (suffix drafts beside a drafter need chains)
    if record.tree and not chains_only:
        SpeculativeConfig(method=name, model=model, tree="dynamic")
    else:
        with pytest.raises(ValueError, match="need chains" if chains_only else "tree drafts need method"):
            SpeculativeConfig(method=name, model=model, tree="dynamic")


def test_the_bench_reads_the_record():
    """The bench's defaults come from the records: suffix decoding's K, the shipped heads' names, `:suffix` for
    a draft model only."""
    assert parse_method("suffix", "t").spec.num_speculative_tokens == 24
    assert parse_method("eagle", "/x/t.gguf").spec.model == shipped_heads_name("t", "eagle") == "t-eagle3"
    assert parse_method("medusa", "t").spec.model == "t-medusa"
    assert parse_method("draft:d:suffix", "t").name == "draft:d:k=3:suffix"
    assert parse_method("draft:d", "t").spec.suffix is False and not parse_method("draft:d", "t").spec.with_suffix
    with pytest.raises(ValueError, match="unknown option"):
        parse_method("medusa:h:suffix:x", "t")
    assert parse_method("auto:tree", "t").spec.auto_tree
