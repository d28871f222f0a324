"""Read what XLA says a compiled step costs: memory, FLOPs, and every collective in the optimized HLO.

Collective bytes use the cost model's convention (costmodel.cost.Collective.bytes_each): the full, unsharded
buffer on one device, i.e. all-reduce: its buffer; all-gather: the gathered output; reduce-scatter: the input
(output x group size); all-to-all and collective-permute: the buffer sent. A ragged all-to-all (dropless MoE)
counts as an all-to-all of the smaller of its operand and its result: the rows a chip sends and gets back when the
routing is balanced (the other is the receive buffer sized for the worst case).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP_RE = re.compile(r"=\s*(?P<type>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                    r"(?P<op>ragged-all-to-all|all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                    r"(?P<start>-start)?\((?P<arg>%[\w.#-]+)?")
_SHAPE_RE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclass(frozen=True)
class HloCollective:
    kind: str
    bytes: float  # cost-model convention, see the module docstring
    group_size: int
    axes: str  # mesh axes the group spans, '+'-joined ('' if it could not be told)
    line: str


def shape_bytes(text: str) -> int:
    total = 0
    for dt, dims in _SHAPE_RE.findall(text):
        if dt not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dt]
    return total


def _groups(line: str) -> list[list[int]]:
    # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}: devices numbered row-major over the named dims; a group spans the
    # braced axes (only the group holding device 0 is built: enough to tell the axes and the size)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
                  r"\s*\{([^}]*)\}", line)
    if m:
        dims = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [n for n, _ in dims], [int(v) for _, v in dims]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):  # device_ids=([a,b]T(perm)): an iota reshaped and transposed, laid over the mesh
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        inside = set(re.findall(r"'([^']+)'", m.group(4)))
        index = tuple(slice(None) if n in inside else 0 for n in names)
        return [ids[index].reshape(-1).tolist()]
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([0-9,]+)\}", m.group(0))]
    return []


def _axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    if not groups or not groups[0]:
        return ""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(np.asarray(groups[0]), sizes)).T  # [members, axes]
    varying = [names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1]
    return "+".join(varying)


def collectives(hlo_text: str, mesh_shape: dict[str, int]) -> list[HloCollective]:
    out = []
    lines = hlo_text.splitlines()
    types = ({d.group(1): d.group(2) for ln in lines if (d := _INSTR_RE.match(ln))}  # a ragged one's operand
             if "ragged-all-to-all" in hlo_text else {})
    for line in lines:
        m = _OP_RE.search(line)
        if not m or "-done" in line.split("=")[0]:
            continue
        kind, typ = m.group("op"), m.group("type")
        nbytes = shape_bytes(typ)
        if kind == "ragged-all-to-all":
            kind = "all-to-all"
            nbytes = min(nbytes, shape_bytes(types.get((m.group("arg") or "%")[1:], typ)))
        if m.group("start") and typ.startswith("("):
            # async start: a tuple of (operands..., results...); count the results half
            parts = _SHAPE_RE.findall(typ)
            if any(d for _, d in parts):  # XLA:TPU appends scalar u32[] context to collective-permute-start
                parts = [p for p in parts if p[1]]
            half = parts[len(parts) // 2:]
            nbytes = shape_bytes(" ".join(f"{d}[{s}]" for d, s in half))
        groups = _groups(line)
        size = len(groups[0]) if groups else 1
        if kind == "collective-permute":
            size = 2
        if kind == "reduce-scatter":
            nbytes *= size
        out.append(HloCollective(kind, float(nbytes), size, _axes(groups, mesh_shape) if kind != "collective-permute"
                                 else _permute_axes(groups, mesh_shape), line.strip()[:200]))
    return out


def _permute_axes(pairs: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """Mesh axes along which some source -> target pair moves (not the axes the set of all pairs spans: a
    pipeline shift over 'pp' runs on every dp/fsdp replica at once)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    moved: set[str] = set()
    for pair in pairs:
        if len(pair) == 2:
            a, b = np.array(np.unravel_index(np.asarray(pair), sizes)).T
            moved |= {names[i] for i in range(len(names)) if a[i] != b[i]}
    return "+".join(n for n in names if n in moved)


def ring_traffic(kind: str, nbytes: float, n: int) -> float:
    """Bytes one device sends in a ring implementation (what bandwidth-bound time is proportional to)."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * nbytes
    return nbytes


def flops(compiled) -> float:
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", 0.0))


def memory(compiled) -> dict[str, float]:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    d = {k: float(getattr(ma, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "temp", "alias")}
    d["peak"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    # XLA's own peak of its buffer assignment (jax >= 0.5; on TPU below `peak`, whose temp is larger than the
    # dumped assignment's: recorded beside it, MaxText's figure stays `peak`)
    d["xla_peak"] = float(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    return d


_COMP_RE = re.compile(r"^(ENTRY\s+)?%([\w.-]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+)\s*=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+([\w-]+)\(")


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """(computation name -> its instruction lines, the ENTRY computation's name) of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    entry, cur = "", None
    for line in hlo_text.splitlines():
        m = _COMP_RE.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif cur is not None:
            comps[cur].append(line)
    return comps, entry


def matmul_flops(hlo_text: str) -> float:
    """2 * output elements * contracted size of every dot in the optimized HLO, weighted by how many times its
    computation is called (fusions, calls); XLA's cost analysis adds element-wise work on top of this."""
    shapes: dict[str, list[int]] = {}
    comps, entry = split_computations(hlo_text)
    for line in (ln for lines in comps.values() for ln in lines):
        im = _INSTR_RE.match(line)
        if im and not im.group(2).startswith("("):
            dims = _SHAPE_RE.findall(im.group(2))[0][1]
            shapes[im.group(1)] = [int(d) for d in dims.split(",") if d]

    def comp_flops(name: str, seen: tuple[str, ...] = ()) -> float:
        total = 0.0
        for line in comps.get(name, []):
            im = _INSTR_RE.match(line)
            if not im:
                continue
            if im.group(3) == "dot":
                out = shapes.get(im.group(1), [])
                ops = re.search(r"dot\(%([\w.-]+),", line)
                lhs = shapes.get(ops.group(1), []) if ops else []
                cd = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
                k = 1
                for i in (int(x) for x in (cd.group(1).split(",") if cd and cd.group(1) else [])):
                    k *= lhs[i] if i < len(lhs) else 1
                total += 2.0 * float(np.prod(out or [0])) * k
            for callee in re.findall(r"(?:calls|to_apply|body|condition)=%([\w.-]+)", line):
                if callee not in seen and im.group(3) not in ("all-reduce", "reduce-scatter", "reduce", "scatter",
                                                              "reduce-window", "select-and-scatter", "sort", "map"):
                    total += comp_flops(callee, (*seen, callee))
        return total

    return comp_flops(entry) if entry else 0.0
