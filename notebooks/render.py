"""Run every notebook top to bottom and store its outputs (text and plots), so that it renders where people read it.

`make notebooks` runs this; tests/test_notebooks.py runs the same `execute` and fails when the stored text
differs from a fresh run. What is stored is normalised so that a re-run on unchanged code is byte-identical:
no execution timing, language_info reduced to its name, stderr dropped (font-cache notices, warnings with
machine paths), consecutive stdout chunks merged (their split depends on flush timing).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat
from nbformat import NotebookNode

NOTEBOOKS = Path(__file__).resolve().parent
INLINE = "module://matplotlib_inline.backend_inline"  # plt.show() stores a PNG, whatever MPLBACKEND says outside
TIMEOUT_S = 240  # per cell; each notebook runs in well under a minute on 2 cores
IMAGE = "image/"


def execute(path: Path, timeout: int = TIMEOUT_S) -> NotebookNode:
    """The notebook at `path`, run in a fresh python3 kernel from notebooks/, with normalised outputs."""
    nb = nbformat.read(path, as_version=4)
    env = {**os.environ, "MPLBACKEND": INLINE, "PYTHONHASHSEED": "0"}
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    return normalize(nb)


def normalize(nb: NotebookNode) -> NotebookNode:
    """Drop what varies between runs of the same code (see the module docstring); in place, returned."""
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _merge_streams([o for o in cell.outputs if not _is_stderr(o)])
    return nb


def _is_stderr(out: NotebookNode) -> bool:
    return out.output_type == "stream" and out.name == "stderr"


def _merge_streams(outputs: list[NotebookNode]) -> list[NotebookNode]:
    merged: list[NotebookNode] = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if out.output_type == "stream" and prev is not None and prev.get("name") == out.name:
            prev.text += out.text
        else:
            merged.append(out)
    return merged


def text_outputs(nb: NotebookNode) -> list[str]:
    """Each code cell's outputs as one text (streams, non-image data, errors): what a fresh run must reproduce."""
    texts = []
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        parts = []
        for out in cell.outputs:
            if out.output_type == "stream":
                parts.append(f"[{out.name}]\n{out.text}")
            elif out.output_type == "error":
                parts.append(f"[error] {out.ename}: {out.evalue}")
            else:
                parts += [f"[{mime}]\n{out.data[mime]}" for mime in sorted(out.data) if not mime.startswith(IMAGE)]
        texts.append("\n".join(parts))
    return texts


def image_cells(nb: NotebookNode) -> list[int]:
    """Indices (among code cells) of the cells whose outputs hold an image."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    return [i for i, c in enumerate(code)
            if any(k.startswith(IMAGE) for o in c.outputs for k in o.get("data", {}))]


def errors(nb: NotebookNode) -> list[str]:
    """'ename: evalue' of every error output."""
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


def main(argv: list[str]) -> int:
    """Re-run the named notebooks (default: all) and write them back; exit 1 if one raised."""
    paths = [Path(a) for a in argv] or sorted(NOTEBOOKS.glob("*.ipynb"))
    failed = 0
    for path in paths:
        t0 = time.perf_counter()
        nb = execute(path)
        nbformat.write(nb, path)
        bad = errors(nb)
        failed += bool(bad)
        print(f"{path}: {len(image_cells(nb))} plots, {time.perf_counter() - t0:.1f} s"
              + (f", ERRORS: {'; '.join(bad)}" if bad else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
