"""The typed modes: every choice of the command line (--recompute, --cp_comm_type, --pp_schedule,
--precision, --kind, --batch_policy) and a benchmark cell's status is a `config.Choice` enum,
kept in its text form wherever it is written (JSON, CSV, f-strings, argparse), compared as a
member everywhere else; the rules read in several places are properties; dtype names map to
dtypes in one table."""
import ast
import csv
import io
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from minimind_parallel.config import DTYPES, Choice, ConfigError, CPCommType, ParallelConfig, Recompute
from minimind_parallel.interop.huggingface import EXPORT_DTYPES
from minimind_parallel.memory.analytic import as_dtype
from minimind_parallel.options import Parser, add_model_args
from minimind_parallel.pipeline_parallel import SCHEDULES, Schedule
from minimind_parallel.tasks import benchmark, export, train
from minimind_parallel.tasks.benchmark.command import BatchPolicy, Kind
from minimind_parallel.tasks.benchmark.outputs import Status
from minimind_parallel.training.mixed_precision import PrecisionMode

PACKAGE = Path(__file__).resolve().parent.parent / "minimind_parallel"
ENUMS = (Recompute, CPCommType, Schedule, PrecisionMode, Kind, BatchPolicy, Status)
# where a value of those enums is held: a name, attribute or key that the comparison reads
HOLDERS = ("recompute", "cp_comm_type", "comm_type", "schedule", "precision", "kind", "status", "batch_policy",
           "mode")


def test_the_command_line_gives_members_and_refuses_other_text_in_argparse_words():
    p = Parser(prog="t")
    add_model_args(p)
    args = p.parse_args(["--recompute", "full", "--cp_comm_type", "ring", "--pp_schedule", "gpipe"])
    assert (args.recompute, args.cp_comm_type, args.pp_schedule) == (Recompute.FULL, CPCommType.RING, Schedule.GPIPE)
    assert all(type(v) is cls for v, cls in [(args.recompute, Recompute), (args.cp_comm_type, CPCommType),
                                             (args.pp_schedule, Schedule)])
    defaults = p.parse_args([])
    assert defaults.recompute is Recompute.NONE and defaults.cp_comm_type is CPCommType.ALL_GATHER
    assert defaults.pp_schedule is Schedule.ONE_F_ONE_B
    bench = benchmark.parser().parse_args(["--kind", "throughput", "--batch_policy", "fixed_global"])
    assert bench.kind is Kind.THROUGHPUT and bench.batch_policy is BatchPolicy.FIXED_GLOBAL
    trained = train.parser().parse_args(["--data_path", "d", "--tokenizer_path", "t", "--precision", "pure"])
    assert trained.precision is PrecisionMode.PURE
    assert train.parser().parse_args(["--data_path", "d", "--tokenizer_path", "t"]).precision is PrecisionMode.MIXED
    with pytest.raises(ConfigError, match=r"invalid choice: 'zero_bubble' \(choose from .*gpipe.*1f1b") as err:
        p.parse_args(["--pp_schedule", "zero_bubble"])
    assert "Schedule." not in str(err.value)   # the choices in their text, not the members' reprs
    assert "{none,selective,full}" in p.format_help() and "(default: 1f1b)" in p.format_help()


def test_a_member_is_its_text_in_json_csv_formatting_and_as_a_dict_key():
    for cls in ENUMS:
        for member in cls:
            assert isinstance(member, Choice) and member == member.value and str(member) == member.value
            assert f"{member}|{member:>12}" == f"{member.value}|{member.value:>12}"
            assert json.dumps({"m": member}) == json.dumps({"m": member.value})
            out = io.StringIO()
            csv.writer(out).writerow([member])
            assert out.getvalue().strip() == member.value
            assert {member: 1}[member.value] == 1 and cls.parse(member.value) is member
        assert cls.values() == tuple(m.value for m in cls)
        assert cls.parse("no such value") == "no such value"
    assert SCHEDULES["gpipe"] is SCHEDULES[Schedule.GPIPE]


def test_the_parallel_config_holds_members_also_when_read_back_from_json():
    par = ParallelConfig(tp=2, cp=2, sequence_parallel=True, recompute="selective", cp_comm_type="a2a")
    assert par.recompute is Recompute.SELECTIVE and par.cp_comm_type is CPCommType.A2A
    text = json.dumps(asdict(par))
    assert '"recompute": "selective"' in text and '"cp_comm_type": "a2a"' in text
    back = ParallelConfig(**json.loads(text))
    assert back == par and back.recompute is Recompute.SELECTIVE and back.cp_comm_type is CPCommType.A2A
    assert ParallelConfig(recompute="some").recompute == "some"   # left for check_layout's one line


def test_the_rules_read_in_several_places_are_properties():
    assert ParallelConfig(tp=4, sequence_parallel=True).sequence_shards == 4
    assert ParallelConfig(tp=4).sequence_shards == 1
    assert [m.lean for m in Recompute] == [False, True, True]


def test_dtype_names_map_in_one_table():
    p = Parser(prog="t")
    add_model_args(p)
    dtype = next(a for a in p._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == tuple(DTYPES) == ("float32", "bfloat16", "float16", "float64")
    assert all(as_dtype(name) is d and as_dtype(d) is d for name, d in DTYPES.items())
    assert EXPORT_DTYPES == {n: d for n, d in DTYPES.items() if n != "float64"}
    export_dtype = next(a for a in export.parser()._actions if a.dest == "dtype")
    assert tuple(export_dtype.choices) == tuple(EXPORT_DTYPES)
    assert DTYPES["bfloat16"] is torch.bfloat16


def string_comparisons(source: str) -> list[str]:
    """The comparisons in `source` of a mode holder (HOLDERS) with the text of a member of ENUMS:
    `par.recompute == "full"`, `kind != "memory"`, `r["status"] == "ok"`, `x in ("selective", "full")`."""
    values = {m.value for cls in ENUMS for m in cls}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        texts = [s for s in sides if _constant_texts(s) and _constant_texts(s) <= values]
        held = [s for s in sides if s not in texts and any(h in ast.unparse(s) for h in HOLDERS)]
        if texts and held:
            found.append(ast.unparse(node))
    return found


def _constant_texts(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return {e.value for e in node.elts}
    return set()


def test_no_mode_is_compared_as_text():
    found = {str(f.relative_to(PACKAGE)): string_comparisons(f.read_text()) for f in sorted(PACKAGE.rglob("*.py"))}
    assert not {f: c for f, c in found.items() if c}


def test_the_text_comparison_check_finds_one():
    found = string_comparisons('if par.recompute == "full" or row["status"] != "ok" or kind in ("memory",):\n'
                               '    pass\nif r["kind"] == "run" or name == "full":\n    pass\n')
    assert found == ["par.recompute == 'full'", "row['status'] != 'ok'", "kind in ('memory',)"]
