#!/usr/bin/env bash
# CUDA validation, prepared as two short runs for a lent GPU machine:
#   device run: command="PARTS=... bash benchmarks/cuda_validate.sh", carry=[".whl"], timeout_s=600
# The machine's image has torch and networkx but not OR-Tools or HiGHS: their wheels travel
# in .whl/ (git-ignored; fetched here with `pip download --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 ... ortools highspy immutabledict
# 'protobuf>=6.33.1,<6.34' -d .whl`). Results go to $OUT (the
# device tool brings them back) or benchmarks/results/cuda. Five parts, each under its own
# time limit so one that hangs leaves the others their results (about 12 minutes in all,
# more than one device call allows: run PARTS="tests chain hf", then PARTS="times cost"):
#   1. tests/test_cuda.py: zoo GPT and ResNet plans at half the activations, measured on the
#      GPU within their budget and their prediction; a plan admits a larger batch;
#   2. issue 13's deep chain (32 x Linear(256,256)+ReLU, batch 4096) planned by dp_nested
#      at 40 MiB (the issue asks 39.2 MiB, 0.75x of the smallest keep-set step on the CPU;
#      on an H200 the least is 39.8 MiB: each bias gradient takes an 8 MiB staging
#      buffer there), run and measured on the GPU;
#   3. Hugging Face Llama and GPT-2 (random weights, width 1024, batch 8 x 512 tokens)
#      side by side with gradient_checkpointing_enable() and selective AC on the GPU;
#   4. step times of the zoo plans made on the roofline model and on op times measured on
#      the GPU, side by side in interleaved rounds (benchmarks/cuda_times.py);
#   5. what regions cost on the zoo models' own ops against what the plan charges
#      (benchmarks/region_cost.py).
# PARTS="tests chain" (say) runs some of them: tests, chain, hf, times, cost.
# Per-op allocator timelines (benchmarks/cuda_timeline.py), for finding where a prediction
# and the allocator part ways, are a separate run.
set -uo pipefail
OUT=${OUT:-benchmarks/results/cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PARTS=" ${PARTS:-tests chain hf times cost} "
"$PY" -c "import torch, ortools; print('torch', torch.__version__, 'ortools', ortools.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"

if [[ $PARTS == *" tests "* ]]; then
  timeout 180 "$PY" -m pytest tests/test_cuda.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"
  echo "tests: exit ${PIPESTATUS[0]}"
fi

if [[ $PARTS == *" chain "* ]]; then
  timeout 90 "$PY" -m chkpt_opt.cli validate chkpt_opt.zoo:relu_chain --budget 40MiB \
    --optimizer none --solver dp_nested --time-limit 30 --device cuda --repeats 5 --json \
    > "$OUT/validate_relu_chain.json" 2>> "$OUT/stderr.txt"
  echo "deep chain: exit $?"; cat "$OUT/validate_relu_chain.json"
fi

if [[ $PARTS == *" hf "* ]]; then
  timeout 200 "$PY" benchmarks/hf_models.py --device cuda --models llama gpt2 --skip-compile \
    --width 1024 --batch 8 --seq 512 --time-limit 8 --repeats 9 --threads 8 \
    -o "$OUT/hf_models" 2>> "$OUT/stderr.txt"
  echo "hf models: exit $?"
fi

if [[ $PARTS == *" times "* ]]; then
  timeout 240 "$PY" benchmarks/cuda_times.py -o "$OUT" 2>> "$OUT/stderr.txt"
  echo "plan times: exit $?"
fi

if [[ $PARTS == *" cost "* ]]; then
  timeout 120 "$PY" benchmarks/region_cost.py --device cuda -o "$OUT" 2>> "$OUT/stderr.txt"
  echo "region costs: exit $?"
fi
