"""Errors for people: every documented bad input of `estimate`, `hardware show` and `models show` gives exit code 2
and exactly one stderr line 'error: ...' naming the field; user YAML files are parsed safely and size-limited, and
every schema error names the file, the field and the expected type. Also: `--json` output is byte-identical
across processes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from cli.main import main
from costmodel.catalog import load_model
from costmodel.model import ModelSpec
from hardware.catalog import PROFILE_DIR, load_hardware
from hardware.chip import Chip, Efficiency, Level
from hardware.errors import InputError
from hardware.fileio import MAX_FILE_BYTES
from hardware.yamlio import read_yaml


def planner(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """Run `planner ARGS` in-process through cli.main.main (InputError -> exit 2 handling included)."""
    monkeypatch.setattr(sys, "argv", ["planner", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, (code, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), err
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, lines[0])
    return lines[0]


BASE = ("estimate", "--model", "llama3-8b", "--hardware", "h100-sxm", "--seq-len", "4096")

def with_base(args: tuple[str, ...]) -> tuple[str, ...]:
    """BASE with the options that `args` gives again dropped (an option given twice is itself an error)."""
    given = set(args[::2]) if all(a.startswith("-") for a in args[::2]) else set()
    base = [BASE[0]] + [x for k, v in zip(BASE[1::2], BASE[2::2], strict=True) if k not in given for x in (k, v)]
    return (*base, *args)


# (extra args, substrings the message must contain). BASE gives llama3-8b (32 heads, 8 kv heads, 32 layers, dense).
ESTIMATE_BAD = {
    "unknown model did-you-mean": (("--model", "lama3-8b", "-n", "8", "--fsdp", "8", "-b", "8"),
                                   ("model", "lama3-8b", "did you mean 'llama3-8b'")),
    "unknown hardware did-you-mean": (("--hardware", "h100", "-n", "8", "--fsdp", "8", "-b", "8"),
                                      ("hardware", "did you mean 'h100-sxm'")),
    "degrees product != chips": (("-n", "8", "--fsdp", "4", "-b", "8"), ("degrees", "product", "chips = 8")),
    "tp does not divide heads": (("-n", "6", "--tp", "6", "-b", "8"), ("tp", "n_heads")),
    "layers not divisible by pp*vpp": (("-n", "3", "--pp", "3", "-b", "8", "--framework", "maxtext"),
                                       ("pp", "n_layers")),  # (Megatron-LM splits layers unevenly)
    "vpp too": (("-n", "4", "--pp", "4", "--vpp", "3", "-b", "8"), ("pp*vpp", "n_layers")),
    "vpp without pp": (("-n", "1", "--vpp", "2", "-b", "8"), ("vpp",)),
    "seq not divisible by cp": (("-n", "8", "--cp", "8", "-b", "8", "--seq-len", "4100"), ("cp", "seq_len")),
    "ep on a dense model": (("-n", "8", "--ep", "8", "-b", "8"), ("ep", "dense")),
    "global batch not divisible": (("-n", "8", "--fsdp", "8", "-b", "12"), ("global_batch", "12")),
    "micro batch makes batch indivisible": (("-n", "8", "--fsdp", "8", "-b", "8", "--micro-batch", "3"),
                                            ("global_batch", "micro_batch")),
    "zero chips": (("-n", "0", "-b", "8"), ("--chips",)),
    "negative chips": (("-n", "-4", "-b", "8"), ("--chips",)),
    "zero global batch": (("-n", "8", "--fsdp", "8", "-b", "0"), ("--global-batch",)),
    "negative seq": (("-n", "8", "--fsdp", "8", "-b", "8", "--seq-len", "-1"), ("--seq-len",)),
    "zero tp": (("-n", "8", "--fsdp", "8", "--tp", "0", "-b", "8"), ("--tp",)),
    "zero dp": (("-n", "8", "--fsdp", "8", "--dp", "0", "-b", "8"), ("--dp",)),
    "negative pp": (("-n", "8", "--fsdp", "8", "--pp", "-2", "-b", "8"), ("--pp",)),
    "zero micro batch": (("-n", "8", "--fsdp", "8", "--micro-batch", "0", "-b", "8"), ("--micro-batch",)),
    "zero vpp": (("-n", "8", "--fsdp", "8", "--vpp", "0", "-b", "8"), ("--vpp",)),
    "zero size model": (("--model", "0B", "-n", "8", "--fsdp", "8", "-b", "8"), ("model", "positive")),
    "negative size model": (("--model", "-5B", "-n", "8", "--fsdp", "8", "-b", "8"), ("model", "positive")),
    "unknown remat policy": (("-n", "8", "--fsdp", "8", "-b", "8", "--remat", "ful"),
                             ("remat", "ful", "did you mean 'full'")),
    "unknown remat tensor": (("-n", "8", "--fsdp", "8", "-b", "8", "--remat", "custom:foo=device"),
                             ("remat tensor", "foo")),
    "unknown remat choice": (("-n", "8", "--fsdp", "8", "-b", "8", "--remat", "custom:qkv_proj=maybe"),
                             ("qkv_proj", "device, remat, offload")),
    "unknown offload": (("-n", "8", "--fsdp", "8", "-b", "8", "--offload", "bogus"), ("bogus",)),
    "unknown framework": (("-n", "8", "--fsdp", "8", "-b", "8", "--framework", "megatrom"),
                          ("framework", "megatron")),
    "unknown precision": (("-n", "8", "--fsdp", "8", "-b", "8", "--precision", "fp4"), ("precision", "bf16")),
    "zero stage out of range": (("-n", "8", "--fsdp", "8", "-b", "8", "--zero", "5"), ("zero",)),
    "slices on a GPU": (("-n", "8", "--fsdp", "8", "-b", "8", "--slices", "2"), ("slices",)),
    "too many chips": (("-n", "262144", "--fsdp", "262144", "-b", "262144"), ("chips", "maximum")),
    "not an integer": (("-n", "8", "--fsdp", "8", "-b", "8", "--seq-len", "abc"), ("--seq-len",)),
    "missing model file": (("--model", "/nonexistent/m.yaml", "-n", "8", "--fsdp", "8", "-b", "8"),
                           ("m.yaml", "not found")),
}


@pytest.mark.parametrize("case", sorted(ESTIMATE_BAD))
def test_estimate_bad_input_is_one_line_exit_2(case, capsys, monkeypatch):
    args, needles = ESTIMATE_BAD[case]
    code, out, err = planner(capsys, monkeypatch, *with_base(args), "--json")
    assert_one_line_error(code, err, *needles)
    assert out == ""


TPU_BAD = {
    "slices do not divide chips": (("-n", "8", "--fsdp", "8", "-b", "8", "--slices", "3"), ("slices", "3")),
    "no torus slice of 6 chips": (("-n", "6", "--fsdp", "6", "-b", "6"), ("slice", "6", "nearest")),
    "slices not spanned by dp/pp/fsdp": (("-n", "8", "--tp", "8", "-b", "8", "--slices", "2"), ("slices", "dcn")),
    "above the profile maximum": (("-n", "100000", "--fsdp", "100000", "-b", "100000"), ("chips", "18432")),
}


@pytest.mark.parametrize("case", sorted(TPU_BAD))
def test_estimate_bad_tpu_layout_is_one_line_exit_2(case, capsys, monkeypatch):
    args, needles = TPU_BAD[case]
    code, out, err = planner(capsys, monkeypatch, "estimate", "--model", "llama3-8b", "--hardware", "tpu-v5p",
                             *args, "--json")
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize("flag", ["--seq-len", "--slices"])
def test_estimate_explicit_zero_is_refused_not_defaulted(flag, capsys, monkeypatch):
    code, out, err = planner(capsys, monkeypatch, *BASE, "-n", "8", "--fsdp", "8", "-b", "8", flag, "0", "--json")
    assert_one_line_error(code, err, flag)


def test_estimate_ep_on_moe_model_not_dividing_experts(capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", "mixtral-8x7b", "--hardware", "h100-sxm",
                           "-n", "3", "--ep", "3", "-b", "3", "--json")
    assert_one_line_error(code, err, "ep", "n_experts")


def test_estimate_missing_required_flag(capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", "llama3-8b", "-n", "8", "--json")
    assert_one_line_error(code, err, "--global-batch")


@pytest.mark.parametrize("args, needles", [
    (("hardware", "show", "h100"), ("hardware", "did you mean 'h100-sxm'")),
    (("hardware", "show", "tpu-v5"), ("hardware", "did you mean 'tpu-v5e'")),
    (("hardware", "show", "/nonexistent/hw.yaml"), ("hw.yaml", "not found")),
    (("hardware", "show"), ("NAME_OR_PATH",)),
    (("models", "show", "lama3-8b"), ("model", "did you mean 'llama3-8b'")),
    (("models", "show", "0B"), ("model", "positive")),
    (("models", "show", "--", "-1T"), ("model", "positive")),
    (("models", "show", "5000T"), ("model", "1000T")),
    (("models", "show", "1K"), ("model", "too small")),
    (("models", "show", "/nonexistent/m.yaml"), ("m.yaml", "not found")),
])
def test_show_commands_bad_input(args, needles, capsys, monkeypatch):
    code, _, err = planner(capsys, monkeypatch, *args)
    assert_one_line_error(code, err, *needles)


# ---- files from users ----------------------------------------------------------------------------------------

def test_python_object_tag_is_rejected_without_running_code(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\nvendor: gpu\n")
    with pytest.raises(InputError, match="evil.yaml"):
        read_yaml(evil)
    for args in (("hardware", "show", str(evil)), ("models", "show", str(evil)),
                 ("estimate", "--model", str(evil), "-n", "1", "-b", "1")):
        code, _, err = planner(capsys, monkeypatch, *args)
        assert_one_line_error(code, err, "evil.yaml")
    assert not marker.exists()


def test_python_name_and_module_tags_are_rejected(tmp_path):
    for i, tag in enumerate(("!!python/name:os.system", "!!python/module:os", "!!python/object:hardware.chip.Chip {}")):
        p = tmp_path / f"tag{i}.yaml"
        p.write_text(f"name: {tag}\n")
        with pytest.raises(InputError, match=f"tag{i}.yaml"):
            read_yaml(p)


def test_oversized_file_is_refused_before_parsing(tmp_path, capsys, monkeypatch):
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "# padding\n" * (MAX_FILE_BYTES // 10 + 10))
    assert big.stat().st_size > MAX_FILE_BYTES
    with pytest.raises(InputError, match=f"big.yaml.*larger than {MAX_FILE_BYTES:,}"):
        read_yaml(big)
    for args in (("hardware", "show", str(big)), ("models", "show", str(big))):
        code, _, err = planner(capsys, monkeypatch, *args)
        assert_one_line_error(code, err, "big.yaml", "larger")


def test_billion_laughs_alias_bomb_is_bounded(tmp_path):
    """Aliases expand to references (not copies) under safe_load; a small bomb file stays a quick InputError."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="bomb.yaml"):
        load_hardware(str(p))


WRONG = {int: ("abc", "integer"), float: ("abc", "number"), bool: ("maybe", "true or false"),
         str: ([1, 2], "string")}


def _fields_with_wrong_values(cls) -> list[tuple[str, object, str]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if typ in WRONG:
            out.append((f.name, *WRONG[typ]))
        elif typing.get_origin(typ) is tuple:
            out.append((f.name, 5, "list"))
        elif dataclasses.is_dataclass(typ):
            out.append((f.name, 5, "mapping"))
    return out


def _preset_data(name: str = "h100-sxm") -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize("field, value, expected", _fields_with_wrong_values(Chip))
def test_hardware_schema_error_names_file_field_and_type(field, value, expected, tmp_path):
    data = _preset_data()
    data[field] = value
    p = tmp_path / "myhw.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_hardware(str(p))
    msg = str(e.value)
    assert "myhw.yaml" in msg and field in msg and expected in msg, msg


@pytest.mark.parametrize("field, value, expected", _fields_with_wrong_values(Level))
def test_hardware_level_schema_error_names_file_field_and_type(field, value, expected, tmp_path):
    data = _preset_data()
    data["levels"][1][field] = value
    p = tmp_path / "lvl.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_hardware(str(p))
    msg = str(e.value)
    assert "lvl.yaml" in msg and f"levels[1].{field}" in msg and expected in msg, msg


@pytest.mark.parametrize("field, value, expected", _fields_with_wrong_values(Efficiency))
def test_hardware_eff_schema_error_names_file_field_and_type(field, value, expected, tmp_path):
    data = _preset_data()
    data["eff"] = {field: value}
    p = tmp_path / "eff.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_hardware(str(p))
    msg = str(e.value)
    assert "eff.yaml" in msg and f"eff.{field}" in msg and expected in msg, msg


MODEL_MIN = dict(name="mine", n_layers=2, d_model=64, n_heads=4, ffn_dim=128, vocab_size=100)


@pytest.mark.parametrize("field, value, expected", _fields_with_wrong_values(ModelSpec))
def test_model_schema_error_names_file_field_and_type(field, value, expected, tmp_path):
    data = dict(MODEL_MIN, **{field: value})
    p = tmp_path / "mymodel.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_model(str(p))
    msg = str(e.value)
    assert "mymodel.yaml" in msg and field in msg and expected in msg, msg


@pytest.mark.parametrize("field", ["n_layers", "d_model", "n_heads", "ffn_dim", "vocab_size"])
def test_model_missing_field_names_file_field_and_type(field, tmp_path):
    data = {k: v for k, v in MODEL_MIN.items() if k != field}
    p = tmp_path / "short.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_model(str(p))
    msg = str(e.value)
    assert "short.yaml" in msg and field in msg and "int" in msg, msg


@pytest.mark.parametrize("field", ["peak_bf16_flops", "hbm_bytes", "levels", "max_chips"])
def test_hardware_missing_field_names_file_field_and_type(field, tmp_path):
    data = _preset_data()
    del data[field]
    p = tmp_path / "short.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as e:
        load_hardware(str(p))
    msg = str(e.value)
    assert "short.yaml" in msg and field in msg, msg


def test_schema_errors_reach_the_cli_as_one_line(tmp_path, capsys, monkeypatch):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(dict(MODEL_MIN, n_layers="many")))
    code, _, err = planner(capsys, monkeypatch, "models", "show", str(p))
    assert_one_line_error(code, err, "bad.yaml", "n_layers", "integer")
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", str(p), "-H", "h100-sxm", "-n", "1", "-b", "1")
    assert_one_line_error(code, err, "bad.yaml", "n_layers", "integer")


@pytest.mark.parametrize("field", ["hbm", "matmul_peak", "attention", "link", "net"])
def test_zero_efficiency_in_user_profile_is_an_input_error(field, tmp_path, capsys, monkeypatch):
    data = _preset_data()
    data["eff"] = {field: 0.0}
    p = tmp_path / "zero_eff.yaml"
    p.write_text(yaml.safe_dump(data))
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", "llama3-8b", "-H", str(p), "-n", "16",
                           "--fsdp", "8", "--tp", "2", "-b", "16", "--json")
    assert_one_line_error(code, err, "zero_eff.yaml", field)


@pytest.mark.parametrize("cf", [".inf", "0.001", "-1.0"])
def test_bad_capacity_factor_is_an_input_error(cf, tmp_path, capsys, monkeypatch):
    p = tmp_path / "cf.yaml"
    p.write_text(yaml.safe_dump(dict(MODEL_MIN, n_experts=4, experts_per_token=2)) + f"capacity_factor: {cf}\n")
    code, out, err = planner(capsys, monkeypatch, "estimate", "--model", str(p), "-H", "h100-sxm", "-n", "1", "-b",
                             "1", "--remat", "none", "--json")
    assert_one_line_error(code, err, "capacity_factor")


# ---- determinism ---------------------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *args],
                          capture_output=True, timeout=300, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("args", [
    ("estimate", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--chips", "64", "--fsdp", "8", "--ep", "8",
     "--global-batch", "128", "--remat", "selective", "--offload", "optimizer", "--framework", "maxtext", "--json"),
    ("estimate", "--model", "llama3-70b", "--hardware", "tpu-v5p", "--chips", "512", "--fsdp", "64", "--tp", "4",
     "--dp", "2", "--slices", "2", "--global-batch", "256", "--json"),
])
def test_estimate_json_is_byte_identical_across_processes(args):
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    json.loads(a.stdout)


def test_suggest_json_is_byte_identical_across_processes():
    if not (Path(__file__).resolve().parents[1] / "cli" / "suggest_cmds.py").exists():
        pytest.skip("planner suggest not present")
    args = ("suggest", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "16", "--global-batch", "64",
            "--top", "3", "--json")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    json.loads(a.stdout)


@pytest.mark.parametrize("field", ["peak_bf16_flops", "hbm_bw_Bps"])
def test_infinite_hardware_number_is_an_input_error(field, tmp_path, capsys, monkeypatch):
    data = _preset_data()
    data[field] = float("inf")
    p = tmp_path / "inf.yaml"
    p.write_text(yaml.safe_dump(data))
    code, _, err = planner(capsys, monkeypatch, "estimate", "--model", "llama3-8b", "-H", str(p), "-n", "8",
                           "--fsdp", "8", "-b", "8", "--json")
    assert_one_line_error(code, err, "inf.yaml", field)


def test_user_text_that_rich_would_read_as_markup_is_printed_as_is(capsys, monkeypatch, tmp_path):
    # '[/y]' is a closing tag to rich and '[b]' a style: both must come out literally, never as a traceback.
    folder = tmp_path / "[b]"
    folder.mkdir()
    path = folder / "m.yaml"
    path.write_text('name: "m[/y]"\nn_layers: 2\nd_model: 64\nn_heads: 4\nffn_dim: 128\nvocab_size: 100\n')
    code, out, err = planner(capsys, monkeypatch, "models", "show", str(path))
    assert code == 0 and "m[/y]" in out, err
    code, out, err = planner(capsys, monkeypatch, "estimate", "-m", str(path), "-H", "h100-sxm", "-n", "8", "-b", "8",
                             "--dp", "8")
    assert code == 0 and "m[/y] on 8 x h100-sxm" in out, err
    csv = folder / "s.csv"
    code, out, err = planner(capsys, monkeypatch, "sweep", "-v", "chips=8,16", "-m", "llama3-8b", "-H", "h100-sxm",
                             "-o", str(csv))
    assert code == 0 and "[b]" in out.replace("\n", ""), err
