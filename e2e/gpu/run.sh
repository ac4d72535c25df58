#!/usr/bin/env bash
# The GPU run (issue 37) on a machine with a CUDA device and its own torch (the device tool's image: Python 3.12,
# torch 2.11 + CUDA 13, Triton, transformers). One command, at most ~8 minutes, everything under $OUT:
#
#   e2e/gpu/prepare.sh                    # here, once: the wheels the image lacks, into .whl/ (git-ignored)
#   e2e/gpu/run.sh                        # there, with .whl carried; `--list`, `--only STAGE...`, `--skip STAGE...`
#
# 1. Fails within seconds, exit 3, "no CUDA device: ..." where torch sees no GPU.
# 2. Installs .whl/*.whl into a folder of their own and links the checkout in as the `shoal` package beside them
#    (PYTHONPATH): the image's torch, Triton and transformers are used as they are, nothing of theirs is replaced.
# 3. Runs e2e/gpu/checks.py (the stages: `e2e/gpu/run.sh --list`): each prints PASS/FAIL with its figures, a failure
#    does not stop the run; the log goes to $OUT/gpu-run.log, the figures to $OUT/gpu-summary.json.
#
# Environment: PYTHON (default python3), OUT (default ./gpu-out), SHOAL_GPU_BUDGET seconds (default 480).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/gpu-out}"
BUDGET="${SHOAL_GPU_BUDGET:-480}"

case " $* " in *" --list "*|*" -h "*|*" --help "*) exec "$PY" e2e/gpu/checks.py "$@" ;; esac

"$PY" - <<'PY' || exit 3
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f"no CUDA device: torch does not import in {sys.executable} ({e})")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU; this run needs one")
PY

mkdir -p "$OUT"
SITE="$(mktemp -d -t shoal-gpu-site.XXXXXX)"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || {
    echo "installing the carried wheels (.whl/) failed" >&2; exit 4; }
else
  echo "warning: no .whl/ wheels (run e2e/gpu/prepare.sh here and carry .whl): relying on the image's packages" >&2
fi
# pyproject maps shoal.engine -> engine/ and shoal.operator -> operator/; links do the same without a build step.
mkdir -p "$SITE/shoal" && ln -s "$PWD/engine" "$SITE/shoal/engine" && ln -s "$PWD/operator" "$SITE/shoal/operator"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# The run's own limit, a minute past the stages' budget: a hang still leaves the log and the summary in $OUT.
timeout --kill-after=10 $((BUDGET + 60)) "$PY" e2e/gpu/checks.py --out "$OUT" --budget "$BUDGET" "$@" 2>&1 \
  | tee "$OUT/gpu-run.log"
exit "${PIPESTATUS[0]}"
