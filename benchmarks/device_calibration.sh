#!/usr/bin/env bash
# One prepared device check, all results in one folder (default: $OUT, else benchmarks/device_results).
#
#   benchmarks/device_calibration.sh [--quick]
#
# On a machine with an NVIDIA GPU (jax with CUDA installed): bf16 matmul rate over shapes, HBM bandwidth,
# then `planner validate` of a plan the GPU count allows against the matching profile (h200 or h100-sxm, from
# the device name), and `planner calibrate --out` on a plan set (one device: `single`; 8 or more: `cpu8`) that
# writes the calibrated profile (calibrated_<profile>.yaml). Without a GPU (or with --quick) the same steps run on 8 host CPU
# devices with small shapes, so the script is tested end to end on the dev machine. Budget: < 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
RESULTS="${OUT:-benchmarks/device_results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$RESULTS/log.txt" >&2; }

log "python: $PY"
"$PY" -c "import jax; print(jax.__version__, jax.devices())" > "$RESULTS/jax_devices.txt" 2>&1 || {
  log "jax is not importable with $PY; install jax (pip install -e '.[validate]' or jax[cuda12])"; exit 2; }
log "devices: $(tail -1 "$RESULTS/jax_devices.txt")"

PLATFORM=$("$PY" -c "import jax; print(jax.devices()[0].platform)" 2>/dev/null)
if [[ "$PLATFORM" == "gpu" && "$QUICK" == 0 ]]; then
  nvidia-smi > "$RESULTS/nvidia_smi.txt" 2>&1 || true
  KIND=$("$PY" -c "import jax; print(jax.devices()[0].device_kind)")
  NDEV=$("$PY" -c "import jax; print(len(jax.devices()))")
  case "$KIND" in
    *H200*) HW=h200 ;;
    *H100*) HW=h100-sxm ;;
    *A100*) HW=a100-80gb ;;
    *B200*) HW=b200 ;;
    *) HW=h100-sxm ;;
  esac
  MB_ARGS=(--dtype bfloat16)
  VAL_ARGS=(--hardware "$HW" --devices "$NDEV" --steps 10 --full-opt --d-model 1024 --layers 4 --seq-len 1024)
  if (( NDEV >= 8 )); then CAL_SET=cpu8; CAL_DEV=8; else CAL_SET=single; CAL_DEV=1; fi
  CAL_ARGS=(--steps 3 --full-opt --d-model 1024 --layers 4 --seq-len 1024)
else
  HW=cpu-host
  MB_ARGS=(--quick --devices 8)
  VAL_ARGS=(--hardware cpu-host --devices 8 --steps 2 --d-model 64 --seq-len 64 --fast-compile)
  CAL_SET=quick; CAL_DEV=8
  CAL_ARGS=(--steps 2 --d-model 64 --seq-len 64 --fast-compile)
fi
log "profile: $HW"

log "matmul rate and memory bandwidth"
timeout 240 "$PY" -m planner.validate.microbench "${MB_ARGS[@]}" > "$RESULTS/microbench.json"
"$PY" - "$RESULTS/microbench.json" "$HW" <<'EOF' | tee "$RESULTS/microbench_summary.txt"
import json, sys
sys.path.insert(0, ".")
from hardware.catalog import load_hardware
d = json.load(open(sys.argv[1]))
chip = load_hardware(sys.argv[2])
n = d["n_devices"] if d["platform"] == "cpu" else 1  # CPU: the profile is per forced host device
print(f"{d['device_kind'] or d['platform']}: best matmul {d['best_matmul_tflops']:.3f} TFLOP/s ({d['dtype']}), "
      f"memory {d['hbm']['GBps']:.1f} GB/s")
for r in d["matmul"]:
    frac = r["tflops"] * 1e12 / (chip.peak_bf16_flops * n)
    print(f"  {r['m']}x{r['k']}x{r['n']}: {r['tflops']:.3f} TFLOP/s = {frac:.2f} of {chip.name} peak")
print(f"  memory: {d['hbm']['GBps'] * 1e9 / (chip.hbm_bw_Bps * n):.2f} of {chip.name} bandwidth")
EOF

# Plans that fit the devices: one device on a single GPU; three sharded plans on 8 CPU devices.
NDEV_ALL=$("$PY" -c "import jax; print(len(jax.devices()))")
[[ "$HW" == "cpu-host" ]] && NDEV_ALL=8
log "planner validate ($NDEV_ALL devices)"
set +e
if [[ "$HW" == "cpu-host" ]]; then
  timeout 300 "$PY" -c "from cli.main import main; main()" validate --set quick "${VAL_ARGS[@]}" --json \
    > "$RESULTS/validate.json" 2> "$RESULTS/validate.err"
else
  timeout 300 "$PY" -c "from cli.main import main; main()" validate --model llama3-8b "${VAL_ARGS[@]}" \
    --dp "$NDEV_ALL" --remat full --json > "$RESULTS/validate.json" 2> "$RESULTS/validate.err"
fi
RC=$?
set -e
log "validate exit code $RC (0: all checks in tolerance, 1: some outside, 2: bad input, 124: timeout)"
"$PY" - "$RESULTS/validate.json" <<'EOF' | tee "$RESULTS/validate_summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print(f"no validate output: {e}")
    sys.exit(0)
for c in d["checks"]:
    err = "-" if c["error_pct"] is None else f"{c['error_pct']:+.1f}%"
    print(f"{c['plan']:24s} {c['quantity']:42s} pred {c['predicted'] or 0:12.5g} xla {c['xla'] or 0:12.5g} {err:>8s} "
          f"{'ok' if c['ok'] else 'NO'}")
EOF
log "planner calibrate --set $CAL_SET ($CAL_DEV devices)"
set +e
timeout 300 "$PY" -c "from cli.main import main; main()" calibrate --hardware "$HW" --set "$CAL_SET" \
  --devices "$CAL_DEV" "${CAL_ARGS[@]}" --out "$RESULTS/calibrated_$HW.yaml" --json \
  > "$RESULTS/calibrate.json" 2> "$RESULTS/calibrate.err"
RC=$?
set -e
log "calibrate exit code $RC (0: all checks in tolerance, 1: some outside, 2: bad input, 124: timeout)"
"$PY" - "$RESULTS/calibrate.json" <<'EOF' | tee "$RESULTS/calibrate_summary.txt"
import json, sys
try:
    c = json.load(open(sys.argv[1]))["calibration"]
except Exception as e:  # noqa: BLE001
    print(f"no calibration output: {e}")
    sys.exit(0)
b, a = c["before"], c["after"]
print(f"{c['rows']} plans: Spearman {b['spearman']:.3f} -> {a['spearman']:.3f}, median |error| "
      f"{b['median_error_pct']:.1f}% -> {a['median_error_pct']:.1f}%; profile {c['profile']}")
print("  " + ", ".join(f"{k}={v:.4g}" for k, v in c["eff"].items()))
EOF
log "done: results in $RESULTS"
