#!/usr/bin/env bash
# Every check that needs a GPU, in one run of at most 8 minutes on one H200 (a lent machine's device
# time is short: one prepared command, each step under its own time limit). Run from the repository
# root with the machine's own python3 and torch (no install: the package is read from here):
#   bash benchmarks/gpu_checks.sh                  # every step; logs in $OUT (the device tool's), else ./gpu-logs
#   bash benchmarks/gpu_checks.sh tests memory     # some steps
# Steps: tests (the CUDA tests), syncs (where a call waits for the GPU), memory (planned and measured
# on the GPU: examples and a tiny zoo), memory-large (two GPU-sized models), step-time (every stage on
# the GPU, predicted against measured), budgets (max_memory plans measured on the GPU), overhead.
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
py=${PYTHON:-python3}
steps=${*:-tests syncs memory memory-large step-time budgets overhead}

step() {  # step NAME SECONDS COMMAND...: the log in $out/NAME.txt, its last lines here
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - began)) s (limit $limit s)"
    grep -v "^\[transformers\]\|warnings.warn\|Warning: \|^  return " "$out/$name.txt" | tail -n "${TAIL:-25}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import torch, transformers, networkx; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'networkx', networkx.__version__)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
TAIL=6 step tests 60 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    "tests/test_measure_memory.py::test_on_cuda_the_peak_is_the_allocators" \
    "tests/test_capture_export.py::test_a_plan_captured_on_one_device_runs_on_another_through_a_higher_order_ops_body"
TAIL=60 step syncs 50 $py benchmarks/call_overhead.py --syncs --only GPT
TAIL=6 step memory 75 $py benchmarks/memory_accuracy.py --quick --device cuda \
    --models residual-mlp,gpt-lm,transformer-lm,hf-gpt2,hf-llama,hf-bert,hf-vit,hf-t5
TAIL=6 step memory-large 60 $py benchmarks/memory_accuracy.py --quick --device cuda --models gpt-lm-gpu,gpt2-small
TAIL=18 step step-time 70 $py benchmarks/one_device_step.py --device cuda --repeats 7
TAIL=3 step budgets 40 $py benchmarks/memory_accuracy.py --budgets --device cuda --models gpt-lm
TAIL=10 step overhead 40 $py benchmarks/call_overhead.py --cuda --quick --only GPT
