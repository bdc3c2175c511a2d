#!/usr/bin/env bash
# Every check that needs a GPU, in one run of at most 7.5 minutes on one H200 (a lent machine's device
# time is short: one prepared command, each step under its own time limit). Run from the repository
# root with the machine's own python3 and torch (no install: the package is read from here):
#   bash benchmarks/gpu_checks.sh        # logs in $OUT (the device tool's folder), else ./gpu-logs
# 1. the CUDA tests; 2. memory measured on the GPU (torch.cuda.max_memory_allocated) against the
# plan, the examples and a tiny zoo, then two GPU-sized models; 3. budgets measured on the GPU;
# 4. the training step with every stage on the GPU, predicted against measured; 5. call overhead.
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: the log in $out/NAME.txt, its last lines here
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - began)) s (limit $limit s)"
    grep -v "^\[transformers\]\|warnings.warn\|UserWarning" "$out/$name.txt" | tail -n "${TAIL:-25}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import torch, transformers, networkx; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'networkx', networkx.__version__)"
    # cuBLAS's workspace comes from the caching allocator at the first matrix product and stays
    $py -c "import torch; a = torch.randn(64, 64, device='cuda'); b = torch.cuda.memory_allocated(); a @ a; \
torch.cuda.synchronize(); print('cuBLAS workspace, bytes:', torch.cuda.memory_allocated() - b)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
TAIL=15 step tests 100 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_runtime_offload.py \
    "tests/test_measure_memory.py::test_on_cuda_the_peak_is_the_allocators"
TAIL=12 step memory 60 $py benchmarks/memory_accuracy.py --quick --device cuda \
    --models residual-mlp,gpt-lm,transformer-lm,hf-gpt2,hf-llama,hf-bert,hf-vit,hf-t5
TAIL=14 step memory-large 120 $py benchmarks/memory_accuracy.py --quick --device cuda --models gpt-lm-gpu,gpt2-small
step step-time 80 $py benchmarks/one_device_step.py --device cuda --repeats 7
TAIL=8 step budgets 40 $py benchmarks/memory_accuracy.py --budgets --device cuda --models gpt-lm
TAIL=10 step overhead 40 $py benchmarks/call_overhead.py --cuda --quick --only GPT
