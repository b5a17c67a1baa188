#!/usr/bin/env bash
# Scale-out on a machine with two CUDA GPUs. Prints two tables:
#   1. training: seconds per update of a random-initialised 0.5B-shaped model (Qwen2.5-0.5B's
#      shape, ~494M parameters) at a fixed global batch (64 groups x 8 completions of 60-200
#      words, 16 groups per update, 4 updates; the first is warm-up), 1 GPU vs 2 GPUs under DDP
#      and FSDP (full state dict saved as HF safetensors), with the speed-up and the largest
#      weight difference to the 1-GPU checkpoint (DDP: same update up to summation order);
#   2. the whole loop: seconds per iteration of `sptool run --recipe svs` (tiny model, real
#      rewards) in 1 process vs 2 processes (`accelerate launch ... -m sptool.cli.main run`),
#      split into generation (solve, challenge) and train steps, then a resume check.
# Environment as for gpu_session.sh (SPTOOL_TINY_GGUF, WHEELS), and TOKENIZER=DIR (default: the
# tiny model's HF directory). Usage:
#   bash benchmarks/scale_out.sh [train] [run]        (default: both)
set -uo pipefail
parts="${*:-train run}"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} NCCL_NVLS_ENABLE=0 SPTOOL_CACHE=${SPTOOL_CACHE:-/tmp/sptool-cache}
export TOKENIZER=${TOKENIZER:-$(python3 -c "from sptool.models.resolve import resolve_model; print(resolve_model('tiny'))" | tail -1)}
ACC="accelerate launch --num_machines 1 --num_processes 2 --mixed_precision bf16 --dynamo_backend no"
FSDP="--use_fsdp --fsdp_sharding_strategy FULL_SHARD --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
  --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer --fsdp_state_dict_type FULL_STATE_DICT \
  --fsdp_use_orig_params true --fsdp_sync_module_states true"

if [[ " $parts " == *" train "* ]]; then
python3 - <<'PY'
import json, os, random, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
tok = AutoTokenizer.from_pretrained(os.environ["TOKENIZER"])
if tok.pad_token is None: tok.pad_token = tok.eos_token
cfg = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/rand"); tok.save_pretrained("/tmp/rand")
rng = random.Random(0); words = "alpha beta gamma delta one two three plus minus equals answer boxed".split()
with open("/tmp/groups.jsonl", "w") as f:
    for g in range(64):
        comps = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 200))) for _ in range(8)]
        f.write(json.dumps({"role": "solver", "prompt": [{"role": "user", "content": f"Problem {g}: what is {g}+{g}?"}],
                            "completions": comps, "rewards": [float(rng.random() < .5) for _ in comps]}) + "\n")
print("random 0.5B-shaped model and 64 groups ready")
PY
opts="/tmp/groups.jsonl -m /tmp/rand --lr 1e-5 --device cuda --groups-per-update 16 --max-tokens-per-micro-batch 16384 -q"
rm -f /tmp/m-*.jsonl
timeout 300 python3 -m sptool.cli.main train-step $opts -o /tmp/ck-1gpu --metrics /tmp/m-1gpu.jsonl 2>&1 | tail -3
timeout 300 $ACC --multi_gpu -m sptool.cli.main train-step $opts -o /tmp/ck-ddp --metrics /tmp/m-ddp.jsonl 2>&1 | grep -vi warn | tail -3
timeout 300 $ACC $FSDP -m sptool.cli.main train-step $opts -o /tmp/ck-fsdp --metrics /tmp/m-fsdp.jsonl 2>&1 | grep -vi warn | tail -3
python3 - <<'PY'
import json, os, statistics
from safetensors.torch import load_file
def weights(name):
    path = f"/tmp/ck-{name}/model.safetensors"
    return load_file(path) if os.path.exists(path) else None
base = weights("1gpu")
rows = []
for name in ("1gpu", "ddp", "fsdp"):
    try:
        lines = [json.loads(l) for l in open(f"/tmp/m-{name}.jsonl")]
    except OSError:
        rows.append((name, None, None, None, None)); continue
    secs = [m["seconds"] for m in lines][1:] or [m["seconds"] for m in lines]
    tps = statistics.median(m["tokens_per_s"] for m in lines[1:] or lines)
    w = weights(name)
    diff = max((w[k].float() - base[k].float()).abs().max().item() for k in base) if w and base else None
    rows.append((name, statistics.median(secs), tps, lines[0].get("world_size"), diff))
one = rows[0][1]
print("| setup | processes | s/update (median of updates 2-4) | tokens/s | speed-up | max abs weight diff vs 1 GPU |")
print("|---|---|---|---|---|---|")
for name, sec, tps, world, diff in rows:
    speed = f"{one / sec:.2f}x" if sec and one else "-"
    print(f"| {name} | {world} | {sec if sec is None else round(sec, 3)} | {tps if tps is None else round(tps)} | {speed} | "
          f"{'-' if diff is None else f'{diff:.2e}'} |")
PY
fi

if [[ " $parts " == *" run "* ]]; then
run_opts="--recipe svs --data fixtures/addition_train.jsonl -n ${ITERS:-3} --set svs.problems=${PROBLEMS:-64}
  --set svs.samples=8 --set svs.variants=2 --set svs.max_solutions=1 --set svs.format_weight=0.1
  --set generation.max_tokens=128 --set train.learning_rate=1e-5 --set train.loss=dr_grpo
  --set model.device=cuda --set model.gen_batch_size=1024 --set verify.workers=8
  --set train.max_tokens_per_micro_batch=32768 -q"
rm -rf /tmp/run-1 /tmp/run-2
timeout 500 python3 -m sptool.cli.main run $run_opts --run-dir /tmp/run-1 2>&1 | tail -3
timeout 500 $ACC --multi_gpu -m sptool.cli.main run $run_opts --run-dir /tmp/run-2 2>&1 | grep -vi warn | tail -3
# resume after rank 0 is SIGKILLed at the start of iteration 2's train step (the launcher then
# ends rank 1 too)
rm -rf /tmp/run-k
SPTOOL_TEST_KILL_AT=2/train:start timeout 500 $ACC --multi_gpu -m sptool.cli.main run $run_opts --run-dir /tmp/run-k 2>&1 | tail -2
timeout 500 $ACC --multi_gpu -m sptool.cli.main run $run_opts --run-dir /tmp/run-k --resume 2>&1 | tail -2
python3 - <<'PY'
import json, collections
def per_iteration(run):
    it = collections.defaultdict(lambda: collections.Counter())
    for line in open(f"{run}/metrics.jsonl"):
        m = json.loads(line)
        part = "train" if m["kind"] == "train" else "generate" if m["kind"] in ("solve", "challenge") else "other"
        it[m["iteration"]][part] += m["wall_s"]
    return it
print("| processes | iteration | generate s | train s | other s | total s |")
print("|---|---|---|---|---|---|")
for run, n in (("/tmp/run-1", 1), ("/tmp/run-2", 2)):
    try:
        for i, c in sorted(per_iteration(run).items()):
            print(f"| {n} | {i} | {c['generate']:.1f} | {c['train']:.1f} | {c['other']:.1f} | {sum(c.values()):.1f} |")
    except OSError as e:
        print(f"| {n} | - | {e} |")
def records(run):
    return {key: entry["sha256"] for key, entry in json.load(open(f"{run}/manifest.json"))["stages"].items()}
try:
    a, b = records("/tmp/run-2"), records("/tmp/run-k")
    print(f"killed rank 0 + --resume: {sum(a[k] == b.get(k) for k in a)}/{len(a)} step outputs identical to the uninterrupted 2-process run")
except OSError as e:
    print("resume check:", e)
PY
fi
