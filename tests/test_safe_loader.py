"""One safe loader for every file the tool reads (issue 31, item 2): model YAMLs, hardware profiles, plan files
(YAML and JSON), MaxText configs, Megatron-LM command lines and runs CSVs. Each hostile file (an alias bomb,
bytes that are not UTF-8, a 5,000-digit integer, nesting 5,000 deep, duplicate keys, a 200 KB field, a file over
the size cap, a folder) gives exit 2 and exactly one short `error:` line, no traceback, in a few seconds; a bad
row of a runs CSV is reported and skipped with the reason, the other rows kept."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cli.main import main
from costmodel.job import Job
from costmodel.plan import Plan
from costmodel.published import MAX_TABLE_ROWS, load_cases
from hardware.errors import InputError
from hardware.fileio import MAX_FILE_BYTES, MAX_TABLE_BYTES
from planner.import_configs import import_maxtext, import_megatron, shell_words
from planner.planfile import load_plan, save_plan

MAX_LINE = 500  # characters of the one error line
MAX_SECONDS = 10.0  # generous: each case takes well under a second alone
RUNS = Path(__file__).resolve().parents[1] / "benchmarks" / "runs_v5p_maxtext.csv"


def planner(capsys, monkeypatch, *args: str) -> tuple[int, str, str, float]:
    """Run `planner ARGS` in-process through cli.main.main: (exit code, stdout, stderr, seconds)."""
    monkeypatch.setattr(sys, "argv", ["planner", *args])
    code = 0
    start = time.perf_counter()
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    seconds = time.perf_counter() - start
    out = capsys.readouterr()
    return code, out.out, out.err, seconds


def assert_refused(result: tuple[int, str, str, float]) -> str:
    code, _, err, seconds = result
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err[-2000:]
    assert len(lines[0]) < MAX_LINE, lines[0][:MAX_LINE]
    assert seconds < MAX_SECONDS, seconds
    return lines[0]


# ---- the hostile files, per kind ---------------------------------------------------------------------------------

def alias_bomb() -> str:
    """9 levels of 9 aliases each: 9**9 (387 million) leaves from 0.5 KB."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nname: x\n"


BIG = "9" * 5000
DEEP = "[" * 5000 + "]" * 5000
FIELD = "x" * 200_000
YAML_CASES: dict[str, bytes] = {
    "alias bomb": alias_bomb().encode(),
    "not UTF-8": b"name: caf\xe9\n",
    "5000-digit integer": f"name: x\nn_layers: {BIG}\n".encode(),
    "nesting 5000 deep": f"name: {DEEP}\n".encode(),
    "duplicate keys": b"name: x\nname: y\n",
    "200 KB field": f"name: {FIELD}\n".encode(),
}
JSON_CASES: dict[str, bytes] = {
    "alias bomb": alias_bomb().encode(),  # not JSON at all
    "not UTF-8": b'{"description": "caf\xe9"}',
    "5000-digit integer": f'{{"version": {BIG}}}'.encode(),
    "nesting 5000 deep": f'{{"version": 1, "plan": {DEEP}}}'.encode(),
    "duplicate keys": b'{"version": 1, "version": 1}',
    "200 KB field": f'{{"version": 1, "description": "{FIELD}"}}'.encode(),
}
MEGATRON_CASES: dict[str, bytes] = {
    "alias bomb": alias_bomb().encode(),
    "not UTF-8": b"--num-layers 32 # caf\xe9\n",
    "5000-digit integer": f"--num-layers {BIG} --hidden-size 4096 --num-attention-heads 32".encode(),
    "nesting 5000 deep": f"--num-layers {DEEP}".encode(),
    "duplicate keys": b"--num-layers 32 --hidden-size 4096 --num-layers 16",
    "200 KB field": f"--num-layers 32 --hidden-size '{FIELD}'".encode(),
}
HEADER = RUNS.read_text().splitlines()[0]
CSV_CASES: dict[str, bytes] = {  # problems with the file as a whole; problems within a row are tested below
    "alias bomb": alias_bomb().encode(),
    "not UTF-8": f"{HEADER}\ncaf\xe9\n".encode("latin-1"),
    "duplicate keys": f"{HEADER},id\n".encode(),
    "200 KB field": f'{HEADER}\nr1,"{FIELD}"\n'.encode(),
}
LIMIT = {"csv": MAX_TABLE_BYTES}
KINDS: dict[str, tuple[str, Callable[[str], tuple[str, ...]], dict[str, bytes]]] = {
    "model YAML": ("yaml", lambda p: ("models", "show", p), YAML_CASES),
    "hardware profile": ("yaml", lambda p: ("hardware", "show", p), YAML_CASES),
    "plan file": ("yaml", lambda p: ("export", "--plan", p, "--format", "json"), YAML_CASES),
    "JSON plan file": ("json", lambda p: ("export", "--plan", p, "--format", "json"), JSON_CASES),
    "MaxText config": ("yml", lambda p: ("estimate", "--from-maxtext", p, "-H", "tpu-v5p", "-n", "8"), YAML_CASES),
    "Megatron command line": ("sh", lambda p: ("estimate", "--from-megatron", p, "-H", "h100-sxm", "-n", "8"),
                              MEGATRON_CASES),
    "runs CSV": ("csv", lambda p: ("bench", "published", "--file", p, "--json"), CSV_CASES),
}
CASES = [(kind, case) for kind, (_, _, cases) in KINDS.items() for case in cases]


@pytest.mark.parametrize("kind,case", CASES, ids=[f"{k}: {c}" for k, c in CASES])
def test_hostile_content_is_one_line(tmp_path, capsys, monkeypatch, kind, case):
    suffix, argv, cases = KINDS[kind]
    p = tmp_path / f"hostile.{suffix}"
    p.write_bytes(cases[case])
    assert_refused(planner(capsys, monkeypatch, *argv(str(p))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_file_over_the_size_cap_is_refused_unread(tmp_path, capsys, monkeypatch, kind):
    suffix, argv, _ = KINDS[kind]
    p = tmp_path / f"big.{suffix}"
    with p.open("wb") as f:  # sparse: the cap is checked on the size, before reading
        f.truncate(LIMIT.get(suffix, MAX_FILE_BYTES) + 1)
    line = assert_refused(planner(capsys, monkeypatch, *argv(str(p))))
    assert "larger than" in line


@pytest.mark.parametrize("kind", list(KINDS))
def test_folder_instead_of_a_file(tmp_path, capsys, monkeypatch, kind):
    suffix, argv, _ = KINDS[kind]
    d = tmp_path / f"folder.{suffix}"
    d.mkdir()
    line = assert_refused(planner(capsys, monkeypatch, *argv(str(d))))
    assert "folder" in line


# ---- runs CSVs: a bad row is reported and skipped, nothing else lost -----------------------------------------------

def _runs(tmp_path: Path, edits: dict[str, dict[str, str]], extra: int = 0) -> Path:
    good = next(csv.DictReader(RUNS.open()))
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(good))
        w.writeheader()
        w.writerow(good)
        for rid, edit in edits.items():
            w.writerow({**good, "id": rid, **edit})
        for i in range(extra):
            w.writerow({**good, "id": f"extra-{i}"})
    return path


def test_bad_rows_are_reported_row_by_row(tmp_path, capsys, monkeypatch):
    path = _runs(tmp_path, {"big": {"n_layers": BIG}, "deep": {"d_model": DEEP}, "esc": {"model_name": "x\x1b[31m"},
                            "chip": {"hardware": "tpu-v9"}, "chips": {"chips": "7"}, "tp0": {"tp": "0"},
                            "ctl\x1b]0;x": {}, "dup": {"tp": "0"}})
    with path.open("a", newline="") as f:  # a second bad row with the same id is reported on its own
        f.write(path.read_text().splitlines()[-1] + "\n")
    code, out, err, seconds = planner(capsys, monkeypatch, "bench", "published", "--file", str(path), "--json")
    assert code == 0 and "Traceback" not in err and seconds < MAX_SECONDS
    rows = {r["id"]: r for r in json.loads(out)["rows"]}
    skipped = {k: r["skipped"] for k, r in rows.items() if "skipped" in r}
    assert "error_pct" in rows["maxtext-v5p-32B-1x128"]
    assert skipped["big"].startswith("n_layers: expected") and len(skipped["big"]) < MAX_LINE
    assert skipped["deep"].startswith("d_model: expected a number") and len(skipped["deep"]) < MAX_LINE
    assert skipped["esc"].startswith("model_name: expected printable characters")
    assert "no hardware profile 'tpu-v9'" in skipped["chip"]
    assert skipped["chips"].startswith("chips: 7 is not the product of the degrees")
    assert skipped["tp0"] == "tp: expected a positive integer, got '0'"
    assert skipped["line 9 ('ctl\\x1b]0;x')"].startswith("id: expected printable characters")
    assert skipped["dup"] == skipped["line 11 ('dup')"]
    assert len(rows) == 10


def test_too_many_rows_refused_before_any_estimate(tmp_path):
    with pytest.raises(InputError, match=f"more than {MAX_TABLE_ROWS:,} rows"):
        load_cases(_runs(tmp_path, {}, extra=MAX_TABLE_ROWS))


def test_a_long_run_of_digits_in_the_notes_is_linear(tmp_path):
    start = time.perf_counter()
    cases, skipped = load_cases(_runs(tmp_path, {"digits": {"notes": "1" * 100_000}}))
    assert time.perf_counter() - start < MAX_SECONDS
    assert [c.id for c in cases][-1] == "digits" and not skipped


# ---- plan files ----------------------------------------------------------------------------------------------------

JOB = Job(seq_len=4096, global_batch=256)
PLAN = Plan(fsdp=16, tp=4)


def test_upper_case_json_suffix_is_saved_and_read_as_json(tmp_path):
    p = save_plan(tmp_path / "P.JSON", "llama3-8b", "tpu-v5p", 64, JOB, PLAN)
    data = json.loads(p.read_text())
    data["predicted"] = {"mfu": 1e-05}  # json.dumps' form; YAML 1.1 would read it as the string '1e-05'
    p.write_text(json.dumps(data))
    assert load_plan(p).predicted == {"mfu": 1e-05}
    p.write_text('{"version": 1, "plan": ' + "[" * 40 + "]" * 40 + "}")  # under Python's recursion limit
    with pytest.raises(InputError, match="P.JSON: nested deeper than 32 levels"):
        load_plan(p)


def test_save_plan_checks_the_path_and_writes_atomically(tmp_path):
    with pytest.raises(InputError, match="^--save-plan .*: is a folder"):
        save_plan(tmp_path, "llama3-8b", "tpu-v5p", 64, JOB, PLAN, flag="--save-plan")
    with pytest.raises(InputError, match="^--save .*does not exist"):
        save_plan(tmp_path / "no" / "p.yaml", "llama3-8b", "tpu-v5p", 64, JOB, PLAN)
    p = save_plan(tmp_path / "p.yaml", "llama3-8b", "tpu-v5p", 64, JOB, PLAN, description="v1")
    before = p.read_text()
    with pytest.raises(InputError):  # fails before writing: the old file is unchanged
        save_plan(p, "llama3-8b", "tpu-v9", 64, JOB, PLAN)
    assert p.read_text() == before and [q.name for q in tmp_path.iterdir()] == ["p.yaml"]


@pytest.mark.parametrize("field,value,needle", [
    ("description", "ok\x1b[2J", "printable text"),
    ("description", "x" * 5000, "at most 4,096 characters"),
    ("model", "llama3-8b\x1b[31m", "printable characters"),
    ("model", "x" * 200, "at most 128 characters"),
    ("model", "models/" + "x" * 2000 + ".yaml", "a path of at most 1,024"),
    ("hardware", "tpu-v5p\nrun: injected", "printable characters"),
])
def test_plan_file_strings_are_data(tmp_path, field, value, needle):
    p = save_plan(tmp_path / "p.json", "llama3-8b", "tpu-v5p", 64, JOB, PLAN)
    data = json.loads(p.read_text())
    data[field] = value
    p.write_text(json.dumps(data))
    with pytest.raises(InputError, match=needle) as e:
        load_plan(p)
    assert field in str(e.value) and len(str(e.value)) < MAX_LINE and str(e.value).isprintable()


def test_saved_description_is_escaped_so_it_loads_back(tmp_path):
    p = save_plan(tmp_path / "p.yaml", "llama3-8b", "tpu-v5p", 64, JOB, PLAN, description="from a\x1b[31mb.yaml")
    assert load_plan(p).description == "from a\\x1b[31mb.yaml"


# ---- MaxText configs -----------------------------------------------------------------------------------------------

SHAPE = ("base_emb_dim: 4096\nbase_num_query_heads: 32\nbase_num_kv_heads: 8\nbase_mlp_dim: 14336\n"
         "base_num_decoder_layers: 32\nvocab_size: 128256\n")


@pytest.mark.parametrize("extra,needle", [
    ("model_name: [llama3.1-8b]\n", "key 'model_name': expected a string, got a list"),
    ("capacity_factor: [1.25]\n", "key 'capacity_factor': expected a number, got a list"),  # read only for MoE
    ("scan_layers: {a: 1}\n", "key 'scan_layers': expected true or false, got a mapping"),
    ("mlp_activations: silu\n", "key 'mlp_activations': expected a list, got a single value"),
    ("mlp_activations: [[silu], linear]\n", "key 'mlp_activations': expected a list such as"),
    ("vocab_size: 1\n", "duplicate key 'vocab_size' at line 7"),
    ("# planner: chips=many\n", "chips: expected a positive integer, got 'many'"),
    ("# planner: model=x\u202eexe.yaml\n", "expected printable characters"),  # right-to-left override
])
def test_maxtext_values_of_the_wrong_kind_are_refused(tmp_path, extra, needle):
    p = tmp_path / "run.yml"
    p.write_text(SHAPE + extra)
    with pytest.raises(InputError, match=needle.replace("[", "\\[")):
        import_maxtext(p, hardware="tpu-v5p", chips=8)


def test_maxtext_blank_lines_are_linear(tmp_path):
    p = tmp_path / "run.yml"
    p.write_text(SHAPE + "\n" * 400_000 + "ici_fsdp_parallelism: 8\n")
    start = time.perf_counter()
    assert import_maxtext(p, hardware="tpu-v5p").planfile.chips == 8
    assert time.perf_counter() - start < MAX_SECONDS


# ---- Megatron-LM command lines -------------------------------------------------------------------------------------

MEG = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 32000 --seq-length 4096 "
       "--micro-batch-size 1")


def test_megatron_repeated_flag_refused_unless_equal(tmp_path):
    p = tmp_path / "args.sh"
    p.write_text(MEG + " --hidden-size 4096 --bf16 --bf16")
    assert import_megatron(p, hardware="h100-sxm", chips=8).planfile.model.d_model == 4096
    p.write_text(MEG + " --tensor-model-parallel-size 2 --tensor-model-parallel-size=4")
    with pytest.raises(InputError, match="argument --tensor-model-parallel-size is given twice, '2' and '4'"):
        import_megatron(p, hardware="h100-sxm", chips=8)
    p.write_text(MEG + " --data-path a --data-path b")  # flags the planner does not read are not its business
    assert import_megatron(p, hardware="h100-sxm", chips=8).planfile.chips == 8


@pytest.mark.parametrize("freq", ["[0]*1000000000000*1000000000", "0", "1+" * 50_000 + "1", "[" * 200 + "]" * 200])
def test_megatron_layer_pattern_is_bounded(tmp_path, freq):
    p = tmp_path / "args.sh"
    p.write_text(MEG + f" --num-experts 8 --moe-layer-freq '{freq}'")
    start = time.perf_counter()
    with pytest.raises(InputError, match="argument --moe-layer-freq: expected a positive integer or a list"):
        import_megatron(p, hardware="h100-sxm", chips=8)
    assert time.perf_counter() - start < MAX_SECONDS


def test_shell_words_are_bash_words_in_linear_time():
    assert shell_words("a 'b c' \"d\\\"e\" f\\ g h#i # comment\n--j \\\n k", "w") == \
        ["a", "b c", 'd"e', "f g", "h#i", "--j", "k"]
    start = time.perf_counter()
    assert len(shell_words('"' + "a" * 999_000 + '"', "w")[0]) == 999_000  # shlex.split: 47 s
    assert time.perf_counter() - start < MAX_SECONDS
    with pytest.raises(InputError, match="quote that is not closed"):
        shell_words("--x 'open", "w")


def test_yaml_with_too_many_values_is_refused_quickly():
    import time

    from hardware.yamlio import MAX_NODES, parse_yaml

    t = time.perf_counter()
    with pytest.raises(InputError, match=f"more than {MAX_NODES:,} values"):
        parse_yaml("\n".join(f"k{i}: {i}" for i in range(120_000)), "f.yaml")
    assert time.perf_counter() - t < 10
    assert len(parse_yaml("\n".join(f"k{i}: {i}" for i in range(1_000)), "f.yaml")) == 1_000
