"""Print XLA's peak_memory_in_bytes whenever a compiled step's memory_analysis() is read.

MaxText's train_compile prints memory_analysis() without that field. Put this folder first on PYTHONPATH of a
MaxText compile (benchmarks/maxtext_memory/run.py passes its environment on) and grep the log for
PEAK_MEMORY_IN_BYTES, e.g.

    MAXTEXT_OUT=/tmp/mt PYTHONPATH=benchmarks/maxtext_memory/peak_probe python benchmarks/maxtext_memory/run.py \
        --only l3-8b_v6e8_b1_s8192_saveqkv --force   # (rewrites that row of results.csv: same figures)
"""

try:
    import jax.stages as _stages

    _memory_analysis = _stages.Compiled.memory_analysis

    def _with_peak(self):
        ma = _memory_analysis(self)
        print("PEAK_MEMORY_IN_BYTES", getattr(ma, "peak_memory_in_bytes", None), flush=True)
        return ma

    _stages.Compiled.memory_analysis = _with_peak
except Exception:  # no jax here: nothing to patch
    pass
