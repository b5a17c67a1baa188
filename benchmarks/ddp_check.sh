#!/usr/bin/env bash
# On a 2-GPU machine: the same train-step update in one process (1 GPU) and under
# `accelerate launch --multi_gpu --num_processes 2` (2 GPUs, NCCL); compare weights and tokens/s.
# Environment: TOKENIZER=DIR (tokenizer files; default: the tiny model's HF directory),
# WHEELS=DIR (wheels installed offline first, on a machine without network).
set -uo pipefail
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} NCCL_NVLS_ENABLE=0
export TOKENIZER=${TOKENIZER:-$(python3 -c "from sptool.models.resolve import resolve_model; print(resolve_model('tiny'))" | tail -1)}
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
print("model and groups ready")
PY
opts="--lr 1e-5 --device cuda --max-tokens-per-micro-batch 16384 -q"
python3 -m sptool.cli.main train-step /tmp/groups.jsonl -m /tmp/rand -o /tmp/single --metrics /tmp/single.jsonl $opts
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no \
  -m sptool.cli.main train-step /tmp/groups.jsonl -m /tmp/rand -o /tmp/dual --metrics /tmp/dual.jsonl $opts 2>&1 | grep -vi warn | tail -5
python3 - <<'PY'
import json
from safetensors.torch import load_file
for name in ("single", "dual"):
    m = json.loads(open(f"/tmp/{name}.jsonl").readline())
    print(name, {k: m.get(k) for k in ("world_size", "loss", "grad_norm", "completion_tokens", "tokens_per_s", "peak_memory_gib", "seconds")})
a, b, base = (load_file(f"/tmp/{n}/model.safetensors") for n in ("single", "dual", "rand"))
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
moved = max((a[k].float() - base[k].float()).abs().max().item() for k in a)
print(f"max |single - dual| = {diff:.3g}; max |single - initial| = {moved:.3g}")
PY
