#!/usr/bin/env bash
# The generation, training and e2e benchmarks on a GPU, in one go (each one bounded by
# its own time limit, so that one that hangs leaves the others' results).
#
#   bash benchmarks/gpu.sh OUT smoke          # seconds each: every code path on the GPU
#   bash benchmarks/gpu.sh OUT full GGUF      # the measured run; GGUF: SmolLM2's .gguf
#
# DEVICE (default cuda) picks the device: `DEVICE=cpu bash benchmarks/gpu.sh OUT smoke`
# runs the same commands on a machine without a GPU; E2E_SECONDS (default 260) bounds the
# e2e run. Results and logs go under OUT;
# copy them into benchmarks/results/ (the GPU files carry a `_cuda` suffix).
set -u
out=$(realpath -m "${1:?usage: gpu.sh OUT smoke|full [GGUF]}")
mode=${2:-smoke}
gguf=${3:-smollm2}
device=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 NEXRL_HOME=${NEXRL_HOME:-/tmp/nexrl_home}
cd "$(dirname "$0")" || exit 1
mkdir -p "$out"

bench() {  # bench NAME SECONDS SCRIPT ARGS...: its output also goes to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: python3 $*"
    timeout "$limit" python3 "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$out/$name.log"
    echo "== $name: exit $rc"
}

python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
if [ "$mode" = smoke ]; then
    tiny=$(python3 -c "from nexrl.models.tiny import default_model_path as p; print(p())")
    bench gen_smoke 60 bench_generation.py --smollm2 --smoke --model-path "$tiny" \
        --dtype bfloat16 --chat --device "$device"
    bench train_smoke 60 bench_training.py --smoke
    bench e2e_smoke 150 bench_e2e.py --smoke --device "$device"
    exit 0
fi
bench generation 150 bench_generation.py --smollm2 --model-path "$gguf" --dtype bfloat16 \
    --chat --device "$device" --repeats 3 --out "$out"
bench training 40 bench_training.py --out "$out"
bench training_large 50 bench_training.py --hidden 1024 --layers 8 --batch 32 --seq 512 \
    --out "$out"
bench e2e "${E2E_SECONDS:-260}" bench_e2e.py --device "$device" --out "$out"
