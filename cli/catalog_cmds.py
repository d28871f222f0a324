"""`planner hardware list|show` and `planner models list|show` (filled in by the catalog work).

Every name, description, source and level name printed through rich goes through cli.render.shown (control
characters and rich markup escaped; issue 31); JSON output is json.dumps's own escaping."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from cli.main import app
from cli.render import shown
from hardware.catalog import efficiency_origin, load_hardware, preset_names
from hardware.chip import Chip
from hardware.yamlio import to_dict

# ==================================================================================================
# hardware: `planner hardware list [--json]`, `planner hardware show NAME_OR_PATH [--json]`
# ==================================================================================================

hardware_app = typer.Typer(
    no_args_is_help=True, help="Hardware profiles: chips, hosts and interconnect levels."
)
app.add_typer(hardware_app, name="hardware")

_TB = 1e12
_GIB = 2**30


def _levels_summary(chip: Chip) -> str:
    """'ici torus 4096 @ 45 GB/s/link; dcn network @ 6.25 GB/s' (innermost level first)."""
    parts = []
    for lv in chip.levels:
        size = f" {lv.domain_chips}" if lv.domain_chips else ""
        unit = "GB/s/link" if lv.kind == "torus" else "GB/s"
        parts.append(f"{shown(lv.name)} {shown(lv.kind)}{size} @ {lv.bw_per_dir_Bps / 1e9:g} {unit}")
    return "; ".join(parts)


@hardware_app.command("list")
def hardware_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of summaries instead of a table."),
) -> None:
    """List the hardware presets."""
    chips = [load_hardware(name) for name in preset_names()]
    if as_json:
        rows = [
            {
                "name": c.name,
                "vendor": c.vendor,
                "peak_bf16_tflops": c.peak_bf16_flops / _TB,
                "hbm_gib": c.hbm_bytes / _GIB,
                "hbm_tb_per_s": c.hbm_bw_Bps / _TB,
                "levels": [lv.name for lv in c.levels],
            }
            for c in chips
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="Hardware presets (per chip; bandwidths one direction)")
    table.add_column("name", style="bold")
    table.add_column("vendor")
    table.add_column("bf16 TFLOP/s", justify="right")
    table.add_column("HBM GiB", justify="right")
    table.add_column("HBM TB/s", justify="right")
    table.add_column("levels (innermost first)")
    for c in chips:
        table.add_row(
            shown(c.name),
            shown(c.vendor),
            f"{c.peak_bf16_flops / _TB:,.4g}",
            f"{c.hbm_bytes / _GIB:,.1f}",
            f"{c.hbm_bw_Bps / _TB:.3g}",
            _levels_summary(c),
        )
    Console().print(table)


def _si(value: float, unit: str) -> str:
    """A number with an SI prefix: 2.765e12, 'B/s' -> '2.765 TB/s'."""
    if value == 0:
        return f"0 {unit}"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _peak(value: float) -> str:
    return _si(value, "FLOP/s") if value > 0 else "- (no faster path; bf16 peak is used)"


def _seconds(value: float) -> str:
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


@hardware_app.command("show")
def hardware_show(
    name_or_path: str = typer.Argument(
        ..., metavar="NAME_OR_PATH", help="A preset name or a path to a YAML profile."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print every field as JSON (SI units)."),
) -> None:
    """Show every field of one hardware profile, with units."""
    chip = load_hardware(name_or_path)
    if as_json:
        typer.echo(json.dumps(to_dict(chip), indent=2))
        return
    table = Table(title=shown(f"{chip.name}: {chip.description}"), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        ("vendor", shown(chip.vendor)),
        ("peak_bf16_flops", _si(chip.peak_bf16_flops, "FLOP/s")),
        ("peak_fp8_flops", _peak(chip.peak_fp8_flops)),
        ("peak_int8_flops", _peak(chip.peak_int8_flops)),
        ("hbm_bytes", f"{chip.hbm_bytes / _GIB:.2f} GiB ({_si(chip.hbm_bytes, 'B')})"),
        ("hbm_bw_Bps", _si(chip.hbm_bw_Bps, "B/s")),
        ("hbm_reserve_frac", f"{chip.hbm_reserve_frac:g} (usable {chip.usable_hbm_bytes / _GIB:.2f} GiB)"),
        ("host_mem_bytes", f"{chip.host_mem_bytes / _GIB:.2f} GiB/chip ({_si(chip.host_mem_bytes, 'B')})"),
        ("host_link_Bps", f"{_si(chip.host_link_Bps, 'B/s')} per chip, one direction"),
        ("chips_per_host", str(chip.chips_per_host)),
        ("max_chips", f"{chip.max_chips:,}"),
        ("power_w", f"{chip.power_w:g} W" if chip.power_w > 0 else "unknown"),
    ]
    for i, lv in enumerate(chip.levels):
        per = "per link" if lv.kind == "torus" else "per chip"
        domain = f"{lv.domain_chips:,} chips" if lv.domain_chips else "unbounded"
        torus = f", {lv.torus_dims}D torus, wrap {shown(lv.wrap_rule)}" if lv.kind == "torus" else ""
        rows.append(
            (
                f"levels[{i}] {shown(lv.name)}",
                f"{shown(lv.kind)}, domain {domain}, {_si(lv.bw_per_dir_Bps, 'B/s')} {per} one direction, "
                f"latency {_seconds(lv.latency_s)}{torus}",
            )
        )
    eff = ", ".join(f"{k} {v:g}" for k, v in to_dict(chip.eff).items())
    rows.append(("eff", eff))
    rows.append(("eff from", shown(efficiency_origin(chip))))
    for i, src in enumerate(chip.sources):
        rows.append(("sources" if i == 0 else "", shown(src)))
    for field_name, value in rows:
        table.add_row(field_name, value)
    Console().print(table)


# ==================================================================================================
# models: (added by the model-catalog work)
# ==================================================================================================

from costmodel import catalog as model_catalog  # noqa: E402
from costmodel.model import ModelSpec  # noqa: E402

models_app = typer.Typer(
    no_args_is_help=True,
    help="Model presets, model YAML files and size shorthands such as 70B or 1T (a dense Llama-3-style shape).",
    short_help="Model presets, model YAML files and size shorthands.",
)
app.add_typer(models_app, name="models")


def _console() -> Console:
    """Rich console; 130 columns when not writing to a terminal (pipes, tests) so tables are not truncated."""
    console = Console()
    return console if console.is_terminal else Console(width=130)


def _experts(m: ModelSpec) -> str:
    if not m.is_moe:
        return "-"
    shared = f"+{m.n_shared_experts}" if m.n_shared_experts else ""
    return f"{m.n_experts}{shared} top-{m.experts_per_token}"


def _model_summary(m: ModelSpec) -> dict:
    return {
        "name": m.name,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": m.n_kv_heads,
        "ffn_dim": m.ffn_dim,
        "vocab_size": m.vocab_size,
        "n_experts": m.n_experts,
        "experts_per_token": m.experts_per_token,
        "total_params": m.total_params(),
        "active_params": m.active_params(),
    }


def _model_counts(m: ModelSpec) -> dict[str, int]:
    """Derived parameter counts (per layer and whole model)."""
    counts = {
        "attn_params_per_layer": m.attn_params(),
        "dense_mlp_params_per_layer": m.dense_mlp_params() if m.n_dense_mlp_layers else 0,
        "moe_params_per_layer": m.moe_layer_params() if m.is_moe else 0,
        "moe_active_params_per_layer": m.moe_layer_params(active=True) if m.is_moe else 0,
        "embedding_params": m.embedding_params(),
        "non_embedding_params": m.non_embedding_params(),
        "total_params": m.total_params(),
        "active_params": m.active_params(),
    }
    return counts


@models_app.command("list")
def models_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of summaries instead of a table."),
) -> None:
    """List the model presets with their shapes and parameter counts."""
    models = [model_catalog.load_model(name) for name in model_catalog.preset_names()]
    if as_json:
        typer.echo(json.dumps([_model_summary(m) for m in models], indent=2))
        return
    table = Table(title="Model presets (also: a .yaml path, or a size such as 70B or 1T)")
    table.add_column("name", style="bold", no_wrap=True, min_width=max(len(m.name) for m in models))
    for col in ("layers", "d_model", "heads/kv", "ffn", "vocab", "experts", "total B", "active B"):
        table.add_column(col, justify="right", no_wrap=True)
    for m in models:
        table.add_row(
            shown(m.name),
            str(m.n_layers),
            str(m.d_model),
            f"{m.n_heads}/{m.n_kv_heads}",
            str(m.ffn_dim),
            str(m.vocab_size),
            _experts(m),
            f"{m.total_params() / 1e9:,.2f}",
            f"{m.active_params() / 1e9:,.2f}",
        )
    _console().print(table)


@models_app.command("show", short_help="Show one model's shape and derived parameter counts.")
def models_show(
    name_or_path: str = typer.Argument(
        ..., metavar="NAME_OR_PATH_OR_SIZE", help="A preset name, a model YAML path or a size (70B, 1T)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print every field and the derived counts as JSON."),
) -> None:
    """Show one model's shape and derived parameter counts (a size shorthand prints its resolved shape)."""
    m = model_catalog.load_model(name_or_path)
    if as_json:
        typer.echo(json.dumps({**to_dict(m), "derived": _model_counts(m)}, indent=2))
        return
    shorthand = model_catalog.is_shorthand(name_or_path)
    if shorthand:
        typer.echo(f"{name_or_path.strip()} -> {model_catalog.describe_shorthand(name_or_path)}")
    table = Table(title=shown(m.name if shorthand else f"{m.name}: {m.description}"), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    fields = to_dict(m)
    for key in ("name", "description", "source"):
        fields.pop(key)
    for key, value in fields.items():
        table.add_row(key, str(value).lower() if isinstance(value, bool) else shown(str(value)))
    for key, value in _model_counts(m).items():
        table.add_row(key, f"{value:,} ({model_catalog.format_params(value)})" if value else "0")
    table.add_row("source", shown(m.source))
    _console().print(table)
