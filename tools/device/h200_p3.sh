#!/usr/bin/env bash
# Issue 4 (P3) measurements on the lent H200 machines (the `device` tool; nvidia-h200-x2). Run from the repo root
# on the device; every phase writes what it measured under $OUT (logs, MLflow stores, summaries):
#
#   bash tools/device/h200_p3.sh setup                 # wheels -> /tmp/site; code+docs corpus -> data/code_docs
#   bash tools/device/h200_p3.sh tests [PATHS] [ARGS]  # every GPU test (kernels, ops, MoE layer incl. EP=2, trainer), or
#                                                      # those under PATHS (e.g. what changed since the last GPU run),
#                                                      # pytest ARGS too (-k "a or b": quoted, one argument)
#   bash tools/device/h200_p3.sh probe GPU MB [PRECS]  # proxy, recipes x 5 recompute scopes at micro-batch MB, 4 steps
#   bash tools/device/h200_p3.sh choose                # T1 micro-batch from the probes at >= 2 micro-batches (every
#                                                      # logs/device/mlflow_probe*.db: tools/device/choose_t1_mb.py)
#   bash tools/device/h200_p3.sh t1 GPU MB GB [PRECS [SCOPES]]  # the T1 twin (16 steps, 10 warm-up), micro-batch MB
#                                                      # (MB = auto: the one `choose` picked; GB = MB then)
#   bash tools/device/h200_p3.sh t1cells GPU MB "fp8:attn_ln_mlp ..." [OVERRIDES]  # T1 cells, one process each (16
#                                                      # steps, the last 6 measured: mxfp4's first 4-12 steps are slow;
#                                                      # OVERRIDES e.g. optimizer=offload; BASE=dir: an older trainer)
#   bash tools/device/h200_p3.sh hostab GPU MB ROUNDS "cell[@VAR=v,VAR=v] ..." [OVERRIDES]  # host-stall A/B: each
#                                                      # cell in its own process under its env settings, ROUNDS times
#                                                      # alternated, nvidia-smi + top beside -> $OUT/step_times.md
#   bash tools/device/h200_p3.sh t1load MB "fp8:attn_ln_mlp mxfp4:attn_ln_mlp"  # each cell on both GPUs at once
#                                                      # (equal load), then tools/device/load_pairs.py's table
#   bash tools/device/h200_p3.sh profile GPU MB "mxfp4:attn_ln_experts ..."  # torch.profiler, steps 4-5, tables+trace
#   bash tools/device/h200_p3.sh mem GPU MB "mxfp4:attn_ln_mlp ..."  # what is live at step 3's memory peak, by site
#   bash tools/device/h200_p3.sh ep2 MB "mxfp4:attn_ln_mlp ..."  # proxy on both GPUs (torchrun, EP2 x DP2), per cell
#   bash tools/device/h200_p3.sh ep2dopt MB "mxfp4:attn_ln_mlp ..."  # ep2 with optimizer=distributed
#   bash tools/device/h200_p3.sh mem2 MB "fp8:attn_ln_mlp ..."  # mem on both GPUs, EP2 x DP2 (each rank's trace)
#   bash tools/device/h200_p3.sh pp2 MB "mxfp4:attn_ln_mlp ..."  # proxy on both GPUs (torchrun, PP2, 1F1B over 4
#                                                      # micro-batches), per cell
#   bash tools/device/h200_p3.sh ep8 MB "mxfp4:attn_ln_mlp ..."  # issue 7 (nvidia-h200-x8): the proxy on 8 GPUs, EP8 x DP8
#   COMMIT=sha bash tools/device/h200_p3.sh layer1 [ARGS]  # P2's V3 MoE layer on one GPU (32 experts), every recipe
#                                                      # -> $OUT/moe_layer (ARGS: fp4moe.bench.moe_layer's)
#   bash tools/device/h200_p3.sh deepgemm              # build DeepGEMM's carried sdist for kernels.grouped_gemm=deepgemm
#   COMMIT=sha bash tools/device/h200_p3.sh layer8     # issue 7: the V3 MoE layer with EP8, every recipe -> $OUT/moe_layer
#   COMMIT=sha bash tools/device/h200_p3.sh kbench [DIR:LABEL [ARGS]]  # kernel benchmark -> $OUT/kernels, side by side
#                                                      # with the baseline copy DIR (carried: git archive, see README);
#                                                      # more copies (candidates): --baseline DIR2:LABEL2 in ARGS
#   bash tools/device/h200_p3.sh swiglu [ARGS]         # fused SwiGLU: GPU tests + benchmark (ARGS: fp4moe.bench.swiglu_fusion's)
#   COMMIT=sha bash tools/device/h200_p3.sh cudacol    # CUDA C++ FP4RowToFP8Col: build, GPU tests, benchmark vs Triton
#   COMMIT=sha bash tools/device/h200_p3.sh kernelset [DIR:LABEL [ARGS]]  # issue 28's kernel measurements in one call:
#                                                      # the L2 probe, kbench (ARGS as kbench's), cudacol -> one file,
#                                                      # $OUT/kernelset.tgz ($OUT returns at most 8 files)
#   bash tools/device/h200_p3.sh example               # examples/megatron_own_model.py (fp4moe.model.api), every recipe
#   COMMIT=sha bash tools/device/h200_p3.sh reproduce [SECS]  # issue 6: python -m fp4moe.reproduce (make reproduce-table's
#                                                      # command) for at most SECS (520); the same call again goes on
#                                                      # (finished cells and benchmarks reused) -> $OUT/repro.tgz
#   bash tools/device/h200_p3.sh outside [ARGS]         # issue 27: memory outside PyTorch (CUDA context, NCCL with a peer
#                                                      # when 2 GPUs, the allocator's gap with and without expandable
#                                                      # segments) -> $OUT/outside_torch_h200.json (ARGS: the tool's)
#   bash tools/device/h200_p3.sh convprobe [STEPS]      # issue 27 part D: tokens/s of the convergence proxy's candidate
#                                                      # sizes (bf16, mxfp4 at the T1 scope) -> which one does 300 M
#                                                      # tokens in one call
#   bash tools/device/h200_p3.sh convrun3 SEED ["bf16 fp8 mxfp4"] [OVERRIDES]  # issue 27 part D: 300 M-token runs
#                                                      # of experiment=proxy_t1_conv_1gpu, the recipes at once on the
#                                                      # one GPU (one recipe: alone); SIGTERM + checkpoint at the
#                                                      # call's end, resumed by the same command (losses only when
#                                                      # shared); replaces convrun RECIPE SEED of sections 23-24
#   bash tools/device/h200_p3.sh conv GPU RECIPE SECS [OVERRIDES]  # F5 twin, one recipe; SIGTERM after SECS -> checkpoint;
#                                                      # the same command later resumes it (machine kept warm)
#
# Needs (carried): .whl/py312/*.whl (megatron-core, hydra, mlflow closure for Python 3.12) and, for conv,
# data/code_docs/code_docs.jsonl.xz + data/code_docs/tokenizer.json (tools/corpus_code_docs.py, built on a CPU
# machine). State that must outlive one call (checkpoints, MLflow stores, the tokenized corpus) lives in
# git-ignored folders of the work tree, which a warm device machine keeps between calls.
set -euo pipefail
: "${OUT:?set OUT to the folder that comes back}"
ROOT=$PWD
STATE=$ROOT/logs/device
mkdir -p "$STATE"
export PYTHONPATH=$ROOT/src:$ROOT/kernels:/tmp/site
export FP4MOE_CKPT_DIR=$ROOT/checkpoints
export FP4MOE_TOKENIZER=$ROOT/data/code_docs/tokenizer.json
export MLFLOW_DISABLE_TELEMETRY=true TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
# Large, varying activation tensors fragment the caching allocator (reserved 25 GB above allocated at micro-batch 34
# without this); megatron-core users set the same.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
COMMON=(train.progress_bar=false hydra/launcher=local)
# DeepGEMM for kernels.grouped_gemm=deepgemm: the `deepgemm` phase builds the carried sdist into DG_DIR (kept while the
# machine stays warm); the extension needs the system libstdc++ first (the image's python loads an older one: segfault
# in std::regex otherwise, results/moe_layer/README.md section "DeepGEMM")
DG_DIR=$ROOT/build/deepgemm/site
if [ -f "$DG_DIR/build/_C.so" ]; then
  export FP4MOE_DEEPGEMM_DIR=$DG_DIR LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6
fi
# the .git here is the session's base commit: COMMIT=sha names the code (benchmarks and MLflow tags record it)
if [ -n "${COMMIT:-}" ]; then export FP4MOE_COMMIT=$COMMIT; fi
# BASE=build/baseline_<sha>: run an earlier commit's trainer (git archive <sha> src kernels conf | tar x -C BASE,
# carried) beside today's, e.g. COMMIT=<sha> BASE=build/baseline_<sha> bash $0 t1cells 0 64 "mxfp4:attn_ln_experts"
if [ -n "${BASE:-}" ]; then
  export PYTHONPATH=$ROOT/$BASE/src:$ROOT/$BASE/kernels:/tmp/site FP4MOE_CONF_DIR=$ROOT/$BASE/conf
fi

store() { echo "sqlite:///$STATE/mlflow_$1.db"; }
# a run folder of its own for each measurement: the trainer's default folder is keyed by the config (the same command
# resumes, a finished run is not trained again), and a cell measured twice is two runs
fresh() { echo "hydra.run.dir=$STATE/runs/$(date +%Y%m%d-%H%M%S-%N)"; }
keep() { cp -f "$STATE"/mlflow_*.db "$OUT"/ 2>/dev/null || true; }

# NPROC NAME MB "recipe:scope ..." OVERRIDES...: each cell on NPROC GPUs (torchrun, one process per GPU), store NAME
gpu_cells() {
  local nproc=$1 name=$2 mb=$3 cells=$4; shift 4
  for cell in $cells; do
    local recipe=${cell%%:*} scope=${cell##*:}
    local log="$STATE/${name}_${recipe}_${scope}_mb$mb.log"
    MLFLOW_TRACKING_URI=$(store "$name") timeout -k 20 300 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$nproc" -m fp4moe.train "$@" "${COMMON[@]}" hydra.mode=RUN "$(fresh)" parallel.micro_batch=$mb \
      precision=$recipe recompute=$scope > "$log" 2>&1 || true
    echo "$recipe $scope: $(grep -h 'done:\|out of GPU memory\|Error' "$log" | tail -1 | cut -c1-160)"
  done
  keep
  (cd "$STATE" && tar czf "$OUT/${name}_logs.tgz" "${name}"_*.log)
}

phase=${1:?phase}; shift
case $phase in
setup)
  if [ ! -f /tmp/site/.done ]; then
    pip install -q --no-index --no-deps --target /tmp/site .whl/py312/*.whl && touch /tmp/site/.done
  fi
  # torchao (carried as build/torchao/*.whl, `pip download torchao --no-deps --only-binary=:all:` on a CPU machine):
  # the kernel benchmark's peers, nothing else imports it
  if ls build/torchao/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/torchao ]; then
    pip install -q --no-index --no-deps --target /tmp/site build/torchao/*.whl
  fi
  if [ -f data/code_docs/code_docs.jsonl.xz ] && [ ! -f data/code_docs/code_docs.jsonl ]; then
    xz -dk -T0 data/code_docs/code_docs.jsonl.xz
  fi
  if [ -f data/code_docs/code_docs.jsonl ]; then
    python3 -m fp4moe.data prepare experiment=proxy_f5_1gpu precision=bf16 \
      > "$OUT/corpus_manifest.json" 2> "$OUT/corpus_prepare.log" || { tail -30 "$OUT/corpus_prepare.log"; exit 1; }
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.csv"
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" > "$OUT/versions.txt"
  ;;
tests)  # [PATHS and pytest args, e.g. tests/ops -k "row_col or wgrad_loop"]: the GPU tests (default: every GPU test)
  if [ $# -eq 0 ]; then   # every GPU test: the Makefile's GPU_TESTS
    set -- $(sed -n 's/^GPU_TESTS *= *//p' Makefile)
  fi
  python3 -m pytest -q -m gpu --durations=12 "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  ;;
probe)  # GPU MB [precisions]: peak memory, saved bytes and step time of every recipe x scope at one micro-batch
  gpu=$1 mb=$2 precs=${3:-bf16,fp8,mxfp4}
  CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "probe${mb}_gpu$gpu") python3 -m fp4moe.train \
    experiment=proxy_t1_1gpu task_name=proxy_t1_probe "${COMMON[@]}" parallel.micro_batch=$mb \
    parallel.global_batch=$mb train.steps=4 train.measure.warmup_steps=2 train.measure.steps=2 precision=$precs \
    recompute=none,attn_ln_experts,attn_ln_mlp,mla_up_proj,full > "$OUT/probe${mb}_gpu$gpu.log" 2>&1 || true
  keep
  grep -h "done:\|out of GPU memory" "$OUT/probe${mb}_gpu$gpu.log" | cut -c1-200 || true
  ;;
choose)
  python3 tools/device/choose_t1_mb.py "$STATE"/mlflow_probe*.db --json "$STATE/t1_choice.json" | tee "$OUT/t1_choice.txt"
  cp -f "$STATE/t1_choice.json" "$OUT/"
  ;;
t1)  # GPU MB GB [precisions [scopes]]: the T1 twin (conf/train/proxy_throughput.yaml: 10 warm-up, 6 measured)
  gpu=$1 mb=$2 gb=$3 precs=${4:-bf16,fp8,mxfp4} scopes=${5:-attn_ln_experts,attn_ln_mlp,mla_up_proj}
  if [ "$mb" = auto ]; then
    mb=$(python3 -c "import json; print(json.load(open('$STATE/t1_choice.json'))['micro_batch'])"); gb=$mb
  fi
  log="$OUT/t1_gpu${gpu}_${precs//,/-}_${scopes//,/-}.log"
  CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "t1_gpu$gpu") python3 -m fp4moe.train experiment=proxy_t1_1gpu \
    "${COMMON[@]}" parallel.micro_batch=$mb parallel.global_batch=$gb precision=$precs recompute=$scopes \
    > "$log" 2>&1 || true
  keep
  grep -h "done:\|out of GPU memory" "$log" | cut -c1-200 || true
  ;;
t1cells)  # GPU MB "recipe:scope ..." [OVERRIDES...]: T1 cells, each in its own process (no allocator state carried
  # between cells); OVERRIDES go to every cell (e.g. train.steps=30 train.measure.steps=20 for a longer window);
  # logs t1_RECIPE_SCOPE[_dq-MODE]_mbMB.log, MODE = $FP4MOE_DISPATCH_QUANTIZE when set, numbered when repeated; each
  # cell checkpoints (if stopped by a signal) into a folder of its own, so that a cell killed by a timeout does not
  # leave the next cell a checkpoint of another precision (an OVERRIDE train.checkpoint_dir=... still wins)
  gpu=$1 mb=$2 cells=$3; shift 3
  for cell in $cells; do
    recipe=${cell%%:*} scope=${cell##*:}
    base="$STATE/t1_${recipe}_${scope}${FP4MOE_DISPATCH_QUANTIZE:+_dq-$FP4MOE_DISPATCH_QUANTIZE}_mb$mb"
    n=1; while [ -e "${base}_$n.log" ]; do n=$((n + 1)); done; log="${base}_$n.log"
    CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "t1_gpu$gpu") python3 -m fp4moe.train experiment=proxy_t1_1gpu \
      "${COMMON[@]}" hydra.mode=RUN "$(fresh)" parallel.micro_batch=$mb parallel.global_batch=$mb precision=$recipe \
      recompute=$scope train.checkpoint_dir="${log%.log}_ckpt" "$@" > "$log" 2>&1 || true
    echo "$recipe $scope ${FP4MOE_DISPATCH_QUANTIZE:-}: $(grep -h 'done:\|out of GPU memory\|Error' "$log" | tail -1 | cut -c1-160)"
    # after every cell, so that a call stopped by its limit (or a `timeout` around this phase) in a later cell still
    # returns the cells that finished
    keep
    (cd "$STATE" && tar czf "$OUT/t1cells_logs.tgz" t1_*.log)
  done
  ;;
hostab)  # GPU MB ROUNDS "recipe:scope[@VAR=v,VAR=v] ..." [OVERRIDES...]: fp8's host stalls (results/train_proxy/README.md
  # section 17), e.g. hostab 0 32 2 "fp8:attn_ln_mlp fp8:attn_ln_mlp@TORCHINDUCTOR_COMPILE_THREADS=1 mxfp4:attn_ln_mlp"
  # train.steps=30 train.measure.steps=20. Each cell runs through t1cells under its settings (recorded as env.* tags);
  # nvidia-smi (200 ms) and top -H (0.5 s, ten busiest threads) log beside; tools/step_times.py reads the store.
  gpu=$1 mb=$2 rounds=$3 cells=$4; shift 4
  stamp=$(date +%H%M%S)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 200 > "$STATE/smi_$stamp.csv" 2>&1 &
  smi=$!
  (top -b -H -d 0.5 -w 220 | grep --line-buffered -A10 '^ *PID' > "$STATE/top_$stamp.txt") 2>/dev/null &
  top=$!
  for _ in $(seq "$rounds"); do
    for spec in $cells; do
      cell=${spec%%@*} envs=""
      [ "$cell" != "$spec" ] && envs=${spec#*@}
      # shellcheck disable=SC2086
      env ${envs//,/ } bash "$0" t1cells "$gpu" "$mb" "$cell" "$@" | sed "s|^|${envs:-defaults}: |"
    done
  done
  kill "$smi" 2>/dev/null || true
  pkill -P "$top" 2>/dev/null || true  # top and grep, the subshell's children
  mkdir -p "$OUT/hostlogs" && xz -T0 -c "$STATE/smi_$stamp.csv" > "$OUT/hostlogs/smi_$stamp.csv.xz"
  xz -T0 -c "$STATE/top_$stamp.txt" > "$OUT/hostlogs/top_$stamp.txt.xz"
  python3 tools/step_times.py "$STATE/mlflow_t1_gpu$gpu.db" --smi "$STATE/smi_$stamp.csv" | tee "$OUT/step_times.md"
  keep
  ;;
t1load)  # MB "recipe:scope ...": each T1 cell on both GPUs at once (equal host load for every cell), then the table
  mb=$1
  for cell in $2; do
    recipe=${cell%%:*} scope=${cell##*:}
    for gpu in 0 1; do
      # one store per GPU (two writers on one sqlite file can lock it); checkpoints inside each run's own folder
      CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "t1load_gpu$gpu") python3 -m fp4moe.train \
        experiment=proxy_t1_1gpu "${COMMON[@]}" train.checkpoint_dir=checkpoints hydra.mode=RUN \
        hydra.run.dir="$STATE/t1load/${recipe}_${scope}_mb${mb}_gpu$gpu" \
        parallel.micro_batch=$mb parallel.global_batch=$mb precision=$recipe recompute=$scope \
        > "$STATE/t1load_${recipe}_${scope}_mb${mb}_gpu$gpu.log" 2>&1 &
    done
    wait
    echo "$recipe $scope $mb: $(grep -h 'done:\|out of GPU memory\|Error' "$STATE"/t1load_"${recipe}_${scope}_mb${mb}"_gpu*.log \
      | cut -c1-120 | tr '\n' ' ')"
  done
  python3 tools/device/load_pairs.py "$STATE"/mlflow_t1load_gpu*.db | tee "$OUT/t1load.md"
  keep
  ;;
profile)  # GPU MB "recipe:scope ..." [OVERRIDES...]: torch.profiler over steps 4-5 of each T1 cell (op tables +
  # trace under $OUT); OVERRIDES go to every cell and into its folder's name (e.g. kernels.bf16_moe=fp4moe)
  gpu=$1 mb=$2 cells=$3; shift 3
  sfx=$(printf '%s' "$*" | tr -c 'a-zA-Z0-9.' '_')
  for cell in $cells; do
    recipe=${cell%%:*} scope=${cell##*:}
    name="profile_${recipe}_${scope}${FP4MOE_DISPATCH_QUANTIZE:+_dq-$FP4MOE_DISPATCH_QUANTIZE}_mb$mb${sfx:+_$sfx}"
    CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "profile_gpu$gpu") python3 -m fp4moe.train \
      experiment=proxy_t1_1gpu "${COMMON[@]}" hydra.mode=RUN "$(fresh)" parallel.micro_batch=$mb parallel.global_batch=$mb \
      precision=$recipe recompute=$scope train.steps=5 train.measure.warmup_steps=3 train.measure.steps=2 'train.profile.steps=[4,5]' \
      train.profile.dir="$STATE/$name" "$@" > "$STATE/$name.log" 2>&1 || true
    head -40 "$STATE/$name/profile_rank0/ops_by_device_time.txt" 2>/dev/null | cut -c1-220
  done
  (cd "$STATE" && tar czf "$OUT/profiles_gpu$gpu.tgz" profile_*)
  ;;
mem)  # GPU MB "recipe:scope ...": allocator history over step 3 (after the 2 warm-up steps reset the peak stats)
  gpu=$1 mb=$2
  for cell in $3; do
    recipe=${cell%%:*} scope=${cell##*:}
    d="$STATE/mem_${recipe}_${scope}_mb$mb"
    CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "mem_gpu$gpu") timeout -k 20 240 python3 -m fp4moe.train \
      experiment=proxy_t1_1gpu "${COMMON[@]}" hydra.mode=RUN "$(fresh)" parallel.micro_batch=$mb parallel.global_batch=$mb \
      precision=$recipe recompute=$scope train.steps=3 train.measure.warmup_steps=2 train.measure.steps=1 'train.profile.steps=[3,3]' \
      train.profile.memory=true train.profile.ops=false train.profile.dir="$d" > "$d.log" 2>&1 || true
    echo "== $recipe $scope mb$mb"; { head -12 "$d/profile_rank0/memory_peak.txt"; sed -n "/^live when the window opened/,\$p" "$d/profile_rank0/memory_peak.txt" | head -40; } 2>/dev/null | cut -c1-200 \
      || grep -h "Error" "$d.log" | tail -2
    (cd "$STATE" && tar czf "$OUT/mem_gpu$gpu.tgz" --exclude='*.pickle' mem_*)  # after each cell: a timeout keeps the rest
  done
  ;;
ep2)  # MB "recipe:scope ...": the proxy on both GPUs, EP2 x DP2 (torchrun), global batch 2 x MB (no accumulation)
  gpu_cells 2 ep2 "$1" "$2" experiment=proxy_t1_2gpu parallel.global_batch=$((2 * $1))
  ;;
ep2dopt)  # MB "recipe:scope ...": as ep2, with the distributed optimizer (fp32 masters + Adam moments sharded over DP2)
  gpu_cells 2 ep2dopt "$1" "$2" experiment=proxy_t1_2gpu parallel.global_batch=$((2 * $1)) optimizer=distributed
  ;;
mem2)  # MB "recipe:scope ...": what is live at step 3's memory peak of EP2 x DP2 cells, on each GPU (profile_rank0/1)
  gpu_cells 2 mem2 "$1" "$2" experiment=proxy_t1_2gpu parallel.global_batch=$((2 * $1)) train.steps=3 \
    train.measure.warmup_steps=2 train.measure.steps=1 'train.profile.steps=[3,3]' train.profile.memory=true \
    train.profile.ops=false "train.profile.dir=$STATE/mem2_\${precision.name}_\${recompute.name}_mb$1"
  (cd "$STATE" && tar czf "$OUT/mem2.tgz" --exclude='*.pickle' mem2_*)
  ;;
pp2)  # MB "recipe:scope ...": the proxy as 2 pipeline stages over NCCL, global batch 4 x MB (1F1B, 4 micro-batches)
  gpu_cells 2 pp2 "$1" "$2" experiment=proxy_t1_1gpu cluster=workstation_2gpu parallel.world_size=2 \
    parallel.pipeline=2 task_name=proxy_pp2 parallel.global_batch=$((4 * $1))
  ;;
ep8)  # MB "recipe:scope ...": issue 7, the proxy on all 8 GPUs, EP8 x DP8 (torchrun), global batch 8 x MB
  gpu_cells 8 ep8 "$1" "$2" experiment=proxy_t1_8gpu parallel.global_batch=$((8 * $1))
  ;;
layer1)  # [bench args]: P2's MoE layer benchmark on one GPU (DeepSeek-V3 shape: 32 experts, top-8, 4096 tokens), every
  # recipe (e.g. --recipes bf16,fp8,mxfp4,fp8@deepgemm,mxfp4@deepgemm after the deepgemm phase)
  mkdir -p "$OUT/moe_layer"
  timeout -k 20 300 python3 -m fp4moe.bench.moe_layer --commit "${COMMIT:-unknown}" --out "$OUT/moe_layer" "$@" 2>&1 | tail -40
  ;;
deepgemm)  # build DeepGEMM (carried: build/deepgemm/deepinfer_gemm-*.tar.gz and include/, elfutils' headers) into
  # DG_DIR for kernels.grouped_gemm=deepgemm; later phases of this warm machine find it
  if [ ! -f "$DG_DIR/build/_C.so" ]; then
    python3 -m fp4moe_kernels.deepgemm build --sdist "$(ls build/deepgemm/deepinfer_gemm-*.tar.gz | tail -1)" \
      --out "$DG_DIR" --headers build/deepgemm/include 2>&1 | tail -5
  fi
  FP4MOE_DEEPGEMM_DIR=$DG_DIR LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 python3 -m fp4moe_kernels.deepgemm check
  ;;
layer8)  # issue 7: DeepSeek-V3's MoE layer with EP8 (256 experts, 32 per GPU, top-8, 4096 tokens per GPU), every recipe
  mkdir -p "$OUT/moe_layer"
  timeout -k 20 540 python3 -m torch.distributed.run --standalone --nproc-per-node 8 -m fp4moe.bench.moe_layer \
    --commit "${COMMIT:-unknown}" --out "$OUT/moe_layer" 2>&1 | tail -40
  ;;
kbench)  # [BASELINE_DIR:LABEL [bench args...]]: the kernel benchmark, and a baseline copy of the kernels beside it
  mkdir -p "$OUT/kernels"
  base=${1:-}; shift || true
  peers=--no-peers  # torchao's quantizers beside ours when setup installed it
  if [ -d /tmp/site/torchao ]; then peers=; fi
  timeout -k 20 400 python3 -m fp4moe_kernels.bench.conversions --out "$OUT/kernels" --commit "${COMMIT:-unknown}" $peers \
    --rep-ms 50 ${base:+--baseline "$base"} "$@" 2>&1 | tail -70
  ;;
swiglu)  # the fused SwiGLU kernels: GPU tests, then fused vs unfused (and % of copy bandwidth) -> $OUT
  python3 -m pytest -q -m gpu tests/kernels/test_swiglu_kernel.py 2>&1 | tee "$OUT/swiglu_gpu_tests.log" | tail -3
  python3 -m fp4moe.bench.swiglu_fusion --out "$OUT" "$@" 2>&1 | tail -40
  ;;
example)  # examples/megatron_own_model.py (fp4moe.model.api) on the GPU: every recipe, then the whole-block recompute
  for recipe in bf16 fp8 mxfp4; do
    python3 examples/megatron_own_model.py --recipe "$recipe" --steps 5 2>&1 | grep -E '^step 5|^recipe|Error' | cut -c1-200
  done
  python3 examples/megatron_own_model.py --recipe mxfp4 --recompute attn_block_ln_experts --steps 5 2>&1 \
    | grep -E '^step 5|Error' | cut -c1-200
  ;;
cudacol)  # the CUDA C++ FP4RowToFP8Col (the default where it builds): built on first use, GPU tests, benchmark
  python3 -m pytest -q -m gpu tests/kernels/test_cuda_col.py 2>&1 | tee "$OUT/cuda_col_gpu_tests.log" | tail -3
  python3 -m fp4moe_kernels.bench.cuda_col --out "$OUT" --commit "${COMMIT:-unknown}" 2>&1 | tail -25
  ;;
kernelset)  # [BASELINE_DIR:LABEL [kbench args...]]: the L2 probe, the kernel benchmark and the CUDA FP4RowToFP8Col
  # variants (with their GPU tests) into one archive; about 5 minutes after setup on an H100
  : "${COMMIT:?COMMIT=sha names the code: the files are labelled by it}"
  ks=$STATE/kernelset_$(date +%H%M%S)
  mkdir -p "$ks"
  timeout -k 10 120 python3 tools/device/l2_bandwidth.py --out "$ks/l2" 2>&1 | tail -12 || true
  OUT=$ks bash "$0" kbench "$@" 2>&1 | grep -v "^ " | tail -45 || true
  OUT=$ks bash "$0" cudacol 2>&1 | tail -12 || true
  (cd "$ks" && tar czf "$OUT/kernelset.tgz" .)
  echo "kernelset: $(cd "$ks" && find . -type f | wc -l) files in \$OUT/kernelset.tgz"
  ;;
reproduce)  # [SECS]: what `make reproduce-table` runs (not make itself: its venv step needs PyPI), into one MLflow
  # store kept between calls; a call cut short by SECS leaves its cell unfinished, the next call runs it again
  secs=${1:-520} rc=0 log=$STATE/repro_$(date +%H%M%S).log
  touch "$STATE/.repro_call"
  : "${COMMIT:?COMMIT=sha names the code: results are labelled and reused by it}"
  MLFLOW_TRACKING_URI=$(store repro) timeout -k 20 "$secs" python3 -m fp4moe.reproduce > "$log" 2>&1 || rc=$?
  pkill -f "fp4moe.train" || true  # a cell the timeout cut short (reproduce's child)
  echo "reproduce: rc=$rc ($log)"; grep -E "^(hardware|kernel|MoE layer|trainer runs|report|reproduce):" "$log" \
    | grep -v "already there\|logged" | cut -c1-240 | tail -40
  new=$(find results/kernels results/moe_layer -newer "$STATE/.repro_call" -type f)
  # shellcheck disable=SC2086
  tar czf "$OUT/repro.tgz" logs/device/mlflow_repro.db logs/device/repro_*.log logs/reproduce results/report $new
  ;;
outside)  # [ARGS]: tools/device/measure_outside_torch.py (its docstring says what each part measures)
  python3 tools/device/measure_outside_torch.py --out "$OUT" "$@" 2>&1 | tee "$OUT/outside_torch.log" | tail -12
  ;;
conv)  # GPU RECIPE SECS [extra overrides...]
  gpu=$1 recipe=$2 secs=$3; shift 3
  rc=0
  CUDA_VISIBLE_DEVICES=$gpu MLFLOW_TRACKING_URI=$(store "conv_$recipe") timeout -s TERM -k 120 "$secs" \
    python3 -m fp4moe.train experiment=proxy_f5_1gpu "${COMMON[@]}" precision=$recipe "$@" \
    >> "$STATE/conv_$recipe.log" 2>&1 || rc=$?
  cp -f "$STATE/conv_$recipe.log" "$OUT/"
  keep
  echo "conv $recipe exit $rc"; grep -h "done:\|Error" "$STATE/conv_$recipe.log" | tail -3 | cut -c1-200 || true
  ;;
convprobe)  # [STEPS]: issue 27 part D, which model trains 300 M tokens in one call: tokens/s of candidate sizes of
  # the convergence proxy (conf/model/proxy_conv.yaml and three variants), bf16 (the slowest recipe) and mxfp4, at
  # the T1 scope of experiment=proxy_t1_conv_1gpu; one process per candidate (a multirun over the recipes)
  steps=${1:-30}
  declare -A cand=(
    [h1024_l4]=""
    [h768_l4]="model.hidden_size=768 model.ffn_hidden_size=2048 model.moe.ffn_hidden_size=384 model.mla.q_lora_rank=256"
    [h1024_l2]="model.num_layers=2"
    [h1536_l4]="model.hidden_size=1536 model.num_attention_heads=12 model.ffn_hidden_size=3968 model.moe.ffn_hidden_size=768 model.mla.q_lora_rank=512 model.mla.kv_lora_rank=384"
  )
  for name in h768_l4 h1024_l2 h1024_l4 h1536_l4; do
    log="$STATE/convprobe_$name.log"
    # shellcheck disable=SC2086
    MLFLOW_TRACKING_URI=$(store convprobe) timeout -k 20 240 python3 -m fp4moe.train experiment=proxy_t1_conv_1gpu \
      "${COMMON[@]}" task_name=proxy_t1_conv_probe train.tokens=null train.steps=$steps train.eval_interval=null \
      train.measure.warmup_steps=10 precision=bf16,mxfp4 ${cand[$name]} > "$log" 2>&1 || true
    grep -h "done:\|out of GPU memory\|Error" "$log" | sed "s/^/$name /" | cut -c1-220 || true
  done
  # the three recipes of the default candidate at once on the one GPU: does sharing the GPU add throughput?
  for recipe in bf16 fp8 mxfp4; do
    MLFLOW_TRACKING_URI=$(store "convprobe3_$recipe") timeout -k 20 240 python3 -m fp4moe.train \
      experiment=proxy_t1_conv_1gpu "${COMMON[@]}" hydra.mode=RUN "$(fresh)" task_name=proxy_t1_conv_probe3 train.tokens=null \
      train.steps=$steps train.eval_interval=null train.measure.warmup_steps=10 precision=$recipe \
      > "$STATE/convprobe_shared3_$recipe.log" 2>&1 &
  done
  wait
  grep -h "done:\|out of GPU memory\|Error" "$STATE"/convprobe_shared3_*.log | sed "s/^/shared3 /" | cut -c1-220 || true
  keep
  (cd "$STATE" && tar czf "$OUT/convprobe_logs.tgz" convprobe_*.log)
  ;;
convrun3)  # SEED [RECIPES] [OVERRIDES]: issue 27 part D, the recipes' runs of one seed at once on the one GPU (three
  # processes get ~1.6x one's throughput from this small model: section 23), each with its own checkpoint folder, run
  # folder and store; SIGTERM 25 s before the call's limit (CALL_START + CALL_LIMIT, the `timeout_s` the call was given,
  # default 600: pass the smaller one when the budget left is below it, or the call is killed before the tar below
  # returns the stores) or at CONV_SECS checkpoints them, the same command in the next
  # call resumes each, and a run whose log says it is done is not started again. Their tokens/s are not a recipe's
  # (the MLflow tag gpu_shared_by says how many runs shared the GPU); their losses are. Checkpoints per rank, the
  # format every H200 run so far resumed from: the sharded default (dist_checkpointing) has not run on a GPU yet.
  seed=$1 recipes=${2:-"bf16 fp8 mxfp4"}; shift 1; [ $# -gt 0 ] && shift 1
  secs=${CONV_SECS:-570}
  if [ -n "${CALL_START:-}" ]; then secs=$((CALL_START + ${CALL_LIMIT:-600} - 25 - $(date +%s))); fi
  if [ "$secs" -lt 60 ]; then echo "convrun3: only $secs s before the call's limit: not started" >&2; exit 2; fi
  n=0; for recipe in $recipes; do n=$((n + 1)); done
  declare -A pids=()
  for recipe in $recipes; do
    log="$STATE/convrun_${recipe}_s$seed.log"
    if [ -f "$log" ] && grep -q "done:" "$log"; then echo "convrun3 $recipe seed $seed: done before"; continue; fi
    # -k 60: a process that has not checkpointed a minute after SIGTERM is killed (exit 137 below)
    MLFLOW_TRACKING_URI=$(store "convrun_${recipe}_s$seed") timeout -s TERM -k 60 "$secs" \
      python3 -m fp4moe.train experiment=proxy_t1_conv_1gpu "${COMMON[@]}" hydra.mode=RUN precision=$recipe \
      hydra.run.dir="$STATE/run_conv_${recipe}_s$seed" train.seed=$seed \
      train.checkpoint_dir="$ROOT/checkpoints/conv_${recipe}_s$seed" "+tracking.tags.gpu_shared_by=$n" \
      train.checkpoint_format=per_rank "$@" \
      >> "$log" 2>&1 &
    pids[$recipe]=$!
  done
  for recipe in "${!pids[@]}"; do  # each run's exit status (timeout's): 0 done, 124 stopped by the SIGTERM at the
    # call's end (the trainer checkpointed; its log says at which step), 137 killed a minute after it (no checkpoint)
    rc=0; wait "${pids[$recipe]}" || rc=$?
    echo "convrun3 $recipe seed $seed exit $rc" | tee -a "$STATE/convrun_${recipe}_s$seed.log"
  done
  for recipe in $recipes; do
    log="$STATE/convrun_${recipe}_s$seed.log"
    echo "convrun3 $recipe seed $seed:"; grep -h "done:\|Error\|resumed from\|stopped\|Fatal\|exit " "$log" \
      | tail -4 | cut -c1-220 || true
  done
  # the host's view of a process that ended with no word (OOM killer, segmentation fault)
  { free -g; dmesg 2>/dev/null | grep -i "killed process\|out of memory\|segfault" | tail -5; } > "$STATE/convrun_host.txt" 2>&1 || true
  # one file back: the tool returns at most 8 files per call
  # with the stacks each run's threads were in when its stop signal came (fp4moe.launch.slurm.Preemption), if any
  (cd "$STATE" && tar czf "$OUT/convrun_s$seed.tgz" convrun_*_s"$seed".log mlflow_convrun_*_s"$seed".db convrun_host.txt \
    $(ls run_conv_*_s"$seed"/signal_stacks_rank*.txt 2>/dev/null))
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
