#!/usr/bin/env bash
# CUDA validation, prepared as one short run for a lent GPU machine:
#   device run: command="bash benchmarks/cuda_validate.sh", timeout_s=540
# It needs only torch (the machine's image has it) and the working tree; results go to
# $OUT (the device tool brings them back) or results/cuda.
set -uo pipefail
OUT=${OUT:-results/cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
timeout 240 "$PY" -m pytest tests/test_cuda.py -q -s -p no:logging -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
for spec in "gpt 0.3GB" "resnet 0.2GB"; do
  set -- $spec
  timeout 120 "$PY" -m chkpt_opt.cli validate "chkpt_opt.zoo:$1" --budget "$2" --device cuda \
    --profile-times --json > "$OUT/validate_$1.json" 2> "$OUT/validate_$1.err"
  echo "validate $1: exit $?"; cat "$OUT/validate_$1.json"
done
