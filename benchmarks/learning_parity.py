"""Learning parity: a bare Dr. GRPO loop, TRL's ``GRPOTrainer`` and ``sptool run --recipe rlvr``.

Every arm trains the same model on the same labelled set with the same prompt, reward (1 for the
right ``\\boxed{}`` answer, 0.1 for a box with a wrong answer, 0 without a box), sampling
(temperature 1, top-p 1, no top-k), token budget, learning rate (constant, AdamW, clip 1.0), batch
(problems × samples per optimizer step, one step per batch) and seed. The default task is the
hard one: two-digit sums (``fixtures/addition_train.jsonl``), the zero-shot prompt
``{question} Put the final answer in \\boxed{}.`` with no assistant prefix and no stop string,
30 steps, held-out greedy accuracy on 300 two-digit sums the training set does not hold
(``fixtures/bench/addition_heldout_300.jsonl``). ``--task small`` is the easy setting of earlier
runs (sums of 2..19, sptool's few-shot ``direct`` prompt, prefix ``\\boxed{``, stop ``}``).

- **bare**: the ~100-line loop below (``model.generate``, reward, one Dr. GRPO step: advantage
  ``r − mean(group)``, loss ``Σ_i A_i Σ_t −log π(y_t) / (N · max_tokens)``), float32 throughout
  (``--bare-bf16``: its training forward under bf16 autocast); nothing from sptool but the data
  files (and the path of the converted tiny model);
- **trl**: ``trl.GRPOTrainer`` (``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``beta=0``,
  transformers generation, constant learning rate, float32; ``--trl-bf16`` for ``bf16=True``);
- **sptool**: ``sptool run --recipe rlvr`` in a subprocess with its defaults and the same values as
  ``--set``; **sptool-fp32** the same with ``train.mixed_precision=no`` and ``model.dtype=fp32``;
  the diagnosis arms **sptool-bf16** (trainer and sampler in bf16: the default before the
  precision fix), **sptool-bf16-sampler** (float32 trainer, bf16 sampler) and
  **sptool-bf16-trainer** (bf16 trainer, float32 sampler); issue 32's corrections for a bf16/fp16
  trainer: **sptool-selfold** (float32, log π_old from the trainer's own forward: the control),
  **sptool-bf16-trainer-selfold**, **sptool-bf16-tis** (also TIS, cap 2),
  **sptool-bf16-fp32head**, **sptool-bf16-selfold-fp32head**, **sptool-fp16-trainer-selfold** and
  **sptool-bf16-selfold** (bf16 sampler too), **sptool-fp16** and **sptool-fp16-selfold** (fp16
  trainer and sampler: a finer rounding step than bf16's, so small updates show). Each sptool arm's steps carry its updates' ratio
  (mean, spread, max, min), clip share, sampler–trainer log-prob gap and TIS weight, from the run's
  ``metrics.jsonl``; the report prints their means per arm.

``--seeds 0,1,2`` runs every arm once per seed (``ARM.seedN.json``). One seed's curve is one
trajectory: a rounding or a rollout sends it down another path, and the binomial error of 300
held-out problems does not hold that spread. The report then adds each arm's mean and standard
error over its seeds, and every arm against ``--reference`` (default ``sptool``, float32): the mean
difference at each evaluation with the standard error of the difference, and whether it stays
above −2 s.e. (issue 32's bar).

Held-out accuracy is measured the same way for every arm, by the function below (greedy, strict:
the last boxed answer must be right): before training, every ``--eval-every`` steps and after the
last; the sptool arms save a checkpoint at those steps and are evaluated from it. Seconds per step
are split into generation, grading, training and the rest (held-out evaluation excluded).
Results: ``OUT/<arm>.json`` per arm, ``OUT/parity.json`` and ``OUT/parity.txt`` (the table) for
every arm found in ``OUT``.

    python benchmarks/learning_parity.py --device cuda --arms sptool,sptool-fp32,bare,trl --out DIR
    python benchmarks/learning_parity.py --device cuda --arms sptool-bf16,sptool-bf16-sampler --parallel 2
    python benchmarks/learning_parity.py --report DIR                      # the table of DIR
    python benchmarks/learning_parity.py --device cpu --steps 2            # smoke test (tiny batch)

On CPU the defaults shrink to a smoke test (2 problems × 2 samples, 8 new tokens, 4 held-out
problems); on CUDA they are 64 × 8, 64 new tokens, all held-out problems. ``--parallel N`` runs N
arms at once on the one GPU (learning curves only: their seconds per step are not comparable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
# sptool arms: the extra --set values of each (train.mixed_precision: the trainer's autocast;
# model.dtype: the precision the generator sharing the trainer's policy samples in)
#: the step decoder with grouped decode attention and sptool's own CUDA graph per KV cache
CAPTURED_STEP = {"model.decoder": "step", "model.decode_attention": "grouped", "model.step_graph": "capture"}
SPTOOL_ARMS = {
    "sptool": {},
    "sptool-fp32": {"train.mixed_precision": "no", "model.dtype": "fp32"},
    "sptool-bf16": {"train.mixed_precision": "bf16", "model.dtype": "bf16"},
    "sptool-bf16-sampler": {"train.mixed_precision": "no", "model.dtype": "bf16"},
    "sptool-bf16-trainer": {"train.mixed_precision": "bf16", "model.dtype": "fp32"},
    "sptool-fp16-trainer": {"train.mixed_precision": "fp16", "model.dtype": "fp32"},
    # issue 32's candidate corrections for a bf16/fp16 trainer (train.old_logprobs: log π_old from
    # the sampler or the trainer's own forward; train.tis_cap: truncated importance sampling between
    # them; train.fp32_head: the LM head and log-softmax in float32 on a bf16 body)
    "sptool-selfold": {"train.mixed_precision": "no", "model.dtype": "fp32", "train.old_logprobs": "trainer"},
    "sptool-bf16-trainer-selfold": {"train.mixed_precision": "bf16", "model.dtype": "fp32",
                                    "train.old_logprobs": "trainer"},
    "sptool-bf16-tis": {"train.mixed_precision": "bf16", "model.dtype": "fp32", "train.old_logprobs": "trainer",
                        "train.tis_cap": 2.0},
    "sptool-bf16-fp32head": {"train.mixed_precision": "bf16", "model.dtype": "fp32", "train.fp32_head": True},
    "sptool-bf16-selfold-fp32head": {"train.mixed_precision": "bf16", "model.dtype": "fp32",
                                     "train.old_logprobs": "trainer", "train.fp32_head": True},
    "sptool-fp16-trainer-selfold": {"train.mixed_precision": "fp16", "model.dtype": "fp32",
                                    "train.old_logprobs": "trainer"},
    "sptool-bf16-selfold": {"train.mixed_precision": "bf16", "model.dtype": "bf16", "train.old_logprobs": "trainer"},
    # fp16 in both trainer and sampler: 3 more mantissa bits than bf16, so an update at lr 1e-5 on
    # |w| ~ 0.1 is no longer below half a rounding step of the forward (precision-h200/probe.json:
    # cosine 0.955 against float32's log-prob change after one update, bf16 0.098)
    "sptool-fp16": {"train.mixed_precision": "fp16", "model.dtype": "fp16"},
    # float32 trainer and sampler with TF32 tensor-core matmuls (float32 storage and accumulation)
    "sptool-tf32": {"train.mixed_precision": "no", "model.dtype": "fp32", "train.tf32": True},
    # a bf16 trainer whose forward sees the float32 master weights (train.weight_rounding, issue 32):
    # split (hi + lo, one more matmul per linear) or stochastic (unbiased, no extra matmul); on the
    # tiny model on CPU the bf16 forward's log-prob change after one update has cosine 0.966 (split)
    # and 0.980 (stochastic, 8 draws) with float32's, against 0.164 for autocast's nearest cast
    # (benchmarks/results/precision-cpu/weight-rounding-probe.json)
    "sptool-bf16-split-selfold": {"train.mixed_precision": "bf16", "model.dtype": "fp32",
                                  "train.old_logprobs": "trainer", "train.weight_rounding": "split"},
    "sptool-bf16-sr-selfold": {"train.mixed_precision": "bf16", "model.dtype": "fp32",
                               "train.old_logprobs": "trainer", "train.weight_rounding": "stochastic"},
    # the split forward in the sampler too: a bf16-autocast sampler sharing the routed model sees
    # every update, where a plain bf16 sampler did not (precision-h200: 0.025 at step 15)
    "sptool-bf16-split": {"train.mixed_precision": "bf16", "model.dtype": "bf16", "train.old_logprobs": "trainer",
                          "train.weight_rounding": "split"},
    "sptool-fp16-selfold": {"train.mixed_precision": "fp16", "model.dtype": "fp16", "train.old_logprobs": "trainer"},
    # issue 33: the default with the step decoder and grouped decode attention (the loop step's
    # generation against TRL's, the curve against the default's), and the same over the bf16-split
    # sampler (bf16 prefill and GEMMs, a bf16 KV cache), the path to 5x bare generate in greedy eval
    "sptool-step": {"model.decoder": "step", "model.decode_attention": "grouped"},
    # ... with sptool's own CUDA graph per KV cache (model.step_graph = capture): one replay a token
    "sptool-step-capture": dict(CAPTURED_STEP),
    # ... with Python's garbage collector scanning everything again (run.gc_freeze, on by default, off)
    "sptool-step-capture-no-gc-freeze": {**CAPTURED_STEP, "run.gc_freeze": False},
    # ... with the majority vote taken beside the reference answer too (verify.vote, auto by default)
    "sptool-step-capture-vote-always": {**CAPTURED_STEP, "verify.vote": "always"},
    # ... with torch's allocator in expandable segments (ARM_ENVIRONMENT)
    "sptool-step-capture-expandable": dict(CAPTURED_STEP),
    "sptool-bf16-split-step": {"train.mixed_precision": "bf16", "model.dtype": "bf16", "train.old_logprobs": "trainer",
                               "train.weight_rounding": "split", "model.decoder": "step",
                               "model.decode_attention": "grouped"},
}
# the arms above were measured when a low-precision trainer took log π_old from the sampler and
# rounded its weights to nearest unless told otherwise; "auto" now picks the trainer's and
# stochastic rounding under bf16 (sptool.train.step.resolve_precision), so they say so explicitly
for _name, _sets in SPTOOL_ARMS.items():
    if _sets.get("train.mixed_precision") in ("bf16", "fp16"):
        _sets.setdefault("train.old_logprobs", "sampler")
        _sets.setdefault("train.weight_rounding", "nearest")
#: environment variables an sptool arm's ``sptool run`` starts with (read before CUDA starts).
#: Expandable segments: torch's caching allocator maps pages into one growing segment instead of
#: one ``cudaMalloc`` a block; the captured step's training took 0.66-1.43 s a step on identical
#: records (issue 33), and this arm, with the updates' allocator counts, shows whether the
#: allocator's ``cudaMalloc``/``cudaFree`` beside the graphs' memory pools is the cause.
ARM_ENVIRONMENT = {"sptool-step-capture-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
#: the per-update numbers of the sptool arms (their run's metrics.jsonl), per step and in the report
UPDATE_METRICS = ("ratio_mean", "ratio_std", "ratio_max", "ratio_min", "clip_fraction", "logprob_gap",
                  "logprob_gap_rms", "logprob_gap_max", "tis_weight_mean", "tis_capped_fraction",
                  "graphs_compiled", "alloc_retries", "device_mallocs", "device_frees")
ARMS = ("bare", "trl", *SPTOOL_ARMS)
TASKS = {
    "sums": {"train": "fixtures/addition_train.jsonl", "heldout": "fixtures/bench/addition_heldout_300.jsonl",
             "prompt": "benchmarks/prompt_zero_shot.txt", "prefix": "", "stop": ""},
    "small": {"train": "fixtures/addition_small_train.jsonl", "heldout": "fixtures/bench/addition_small_heldout.jsonl",
              "prompt": "src/sptool/prompts/solve_direct.txt", "prefix": "\\boxed{", "stop": "}"},
}
PARTS = ("generation", "grading", "training", "other")


@dataclass
class Settings:
    device: str
    steps: int
    problems: int
    samples: int
    max_tokens: int
    lr: float
    seed: int
    eval_every: int
    micro_batch: int
    model: str = "tiny"
    task: str = "sums"
    train: str = str(ROOT / TASKS["sums"]["train"])
    heldout: str = str(ROOT / TASKS["sums"]["heldout"])
    heldout_limit: int = 0
    prompt: str = str(ROOT / TASKS["sums"]["prompt"])
    prefix: str = ""  # the assistant's reply starts here (every arm)
    stop: str = ""  # and ends at this string
    bare_bf16: bool = False  # the bare loop's training forward under bf16 autocast
    trl_bf16: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def eval_steps(self) -> list[int]:
        steps = {0, self.steps} | set(range(self.eval_every, self.steps + 1, self.eval_every or self.steps + 1))
        return sorted(steps)


# ---------------------------------------------------------------------------- shared pieces

def read_jsonl(path: str, limit: int = 0) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return records[:limit] if limit else records


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def same_answer(given: str, gold: str) -> bool:
    """The boxed answer (its part after the last "=": "47 + 38 = 85") is the gold number."""
    given = given.rsplit("=", 1)[-1]

    def norm(value: str) -> str:
        return re.sub(r"[\s$,]|\\!|\\,", "", value).rstrip(".")
    a, b = norm(given), norm(str(gold))
    try:
        return math.isclose(float(a), float(b))
    except ValueError:
        return a == b


def reward(text: str, gold: str) -> float:
    """1 for the right boxed answer, 0.1 for a wrong one in a box, 0 without a box."""
    boxed = last_boxed(text)
    if boxed is None:
        return 0.0
    return 1.0 if same_answer(boxed, gold) else 0.1


def fill(template: str, question: str) -> str:
    return template.replace("{question}", question)


def render(tokenizer, template: str, question: str, settings: "Settings") -> str:
    """The chat-template prompt text, then the assistant prefix (as sptool's backends do)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": fill(template, question)}],
                                         tokenize=False, add_generation_prompt=True) + settings.prefix


def stop_options(tokenizer, settings: "Settings") -> dict:
    """``generate`` options that end a sequence at the stop string."""
    return {"stop_strings": [settings.stop], "tokenizer": tokenizer} if settings.stop else {}


def model_path(model: str) -> str:
    """A directory ``from_pretrained`` loads: ``tiny`` is sptool's converted copy of the GGUF."""
    if model == "tiny":
        sys.path.insert(0, str(ROOT / "src"))
        from sptool.models.resolve import resolve_model

        return resolve_model("tiny")
    return model


def load_model(settings: Settings):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(settings.device)
    return model, tokenizer


def eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    return ids + [tokenizer.eos_token_id] if tokenizer.eos_token_id not in ids else ids


def sync(settings: Settings) -> None:
    if settings.cuda:
        import torch

        torch.cuda.synchronize()


def greedy_accuracy(model, tokenizer, problems: list[dict], template: str, settings: Settings) -> float:
    """Held-out greedy accuracy: the last boxed answer of a greedy completion is the gold one."""
    import torch

    was_training = model.training
    model.eval()
    texts = [render(tokenizer, template, p["question"], settings) for p in problems]
    right = 0
    for start in range(0, len(texts), 256):
        encoded = tokenizer(texts[start:start + 256], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(settings.device)
        with torch.inference_mode():
            out = model.generate(**encoded, do_sample=False, max_new_tokens=settings.max_tokens,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                 temperature=None, top_p=None, top_k=None, **stop_options(tokenizer, settings))
        completions = [settings.prefix + c for c in
                       tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)]
        right += sum(reward(c, p["answer"]) == 1.0 for c, p in zip(completions, problems[start:start + 256]))
    model.train(was_training)
    return right / len(problems)


class Recorder:
    """Per-step timings and held-out accuracies of one arm; printed as they come, saved as JSON."""

    def __init__(self, arm: str, settings: Settings, tag: str = ""):
        self.arm, self.settings, self.tag = arm, settings, tag
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self.notes: dict = {}
        self.began = time.time()
        self.out: Path | None = None

    def step(self, step: int, seconds: dict, **extra) -> None:
        parts = {part: float(seconds.get(part, 0.0)) for part in PARTS[:3]}
        total = float(seconds["total"])
        parts["other"] = max(0.0, total - sum(parts.values()))
        checkpoint = float(seconds.get("checkpoint", 0.0))
        self.steps.append({"step": step, "total": total, **parts, "checkpoint": checkpoint, **extra})
        shown = " ".join(f"{part[:5]} {parts[part]:.2f}" for part in PARTS)
        if checkpoint:
            shown += f"; checkpoint copy {checkpoint:.2f}, not counted"
        if extra.get("gc_s") is not None:
            shown += f"; of which garbage collection {extra['gc_s']:.2f}"
        if extra.get("graphs_compiled"):
            shown += f"; the update compiled {extra['graphs_compiled']} graphs"
        if extra.get("alloc_retries") or extra.get("device_mallocs") or extra.get("device_frees"):
            shown += (f"; its allocator: {extra.get('device_mallocs')} cudaMalloc, {extra.get('device_frees')} "
                      f"cudaFree, {extra.get('alloc_retries')} retries")
        reward_text = f" reward {extra['mean_reward']:.3f}" if extra.get("mean_reward") is not None else ""
        print(f"[{self.arm}{self.tag}] step {step}/{self.settings.steps}: {total:.2f} s ({shown}){reward_text}",
              file=sys.stderr, flush=True)

    def evaluation(self, step: int, accuracy: float, seconds: float) -> None:
        self.evals.append({"step": step, "greedy_accuracy": accuracy, "seconds": seconds,
                           "problems": self.heldout_size()})
        print(f"[{self.arm}{self.tag}] held-out greedy accuracy after {step} steps: {accuracy:.3f} ({seconds:.1f} s)",
              file=sys.stderr, flush=True)
        if self.out is not None:  # saved as it goes: a run cut short keeps what it measured
            self.save(self.out)

    def heldout_size(self) -> int:
        if not hasattr(self, "_heldout_size"):
            self._heldout_size = len(read_jsonl(self.settings.heldout, self.settings.heldout_limit))
        return self._heldout_size

    def save(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.arm}{self.tag}.json"
        data = {"arm": self.arm, "settings": asdict(self.settings), "steps": self.steps, "evals": self.evals,
                "notes": self.notes, "wall_s": time.time() - self.began}
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        return path


class Clock:
    """Seconds spent per part within one step (CUDA-synchronised at each boundary)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.seconds: dict[str, float] = {}

    def part(self, name: str):
        clock = self

        class Part:
            def __enter__(self):
                sync(clock.settings)
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                sync(clock.settings)
                clock.seconds[name] = clock.seconds.get(name, 0.0) + time.perf_counter() - self.start

        return Part()


# ---------------------------------------------------------------------------- (a) bare loop

def run_bare(settings: Settings, recorder: Recorder) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(settings.seed)
    model, tokenizer = load_model(settings)
    template = Path(settings.prompt).read_text(encoding="utf-8")
    train, heldout = read_jsonl(settings.train), read_jsonl(settings.heldout, settings.heldout_limit)
    stops = torch.tensor(eos_ids(model, tokenizer), device=settings.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if settings.cuda and settings.bare_bf16 \
        else torch.autocast(settings.device.split(":")[0], enabled=False)
    order: list[int] = []

    def evaluate(step: int) -> None:
        begin = time.perf_counter()
        accuracy = greedy_accuracy(model, tokenizer, heldout, template, settings)
        recorder.evaluation(step, accuracy, time.perf_counter() - begin)

    evaluate(0)
    for step in range(1, settings.steps + 1):
        clock = Clock(settings)
        begin = time.perf_counter()
        while len(order) < settings.problems:  # seeded epochs over the training set
            epoch = list(range(len(train)))
            random.Random(settings.seed * 1000 + step).shuffle(epoch)
            order.extend(epoch)
        batch, order = [train[i] for i in order[:settings.problems]], order[settings.problems:]
        texts = [render(tokenizer, template, p["question"], settings) for p in batch]
        encoded = tokenizer([t for t in texts for _ in range(settings.samples)], return_tensors="pt",
                            padding=True, add_special_tokens=False).to(settings.device)
        with clock.part("generation"):
            model.eval()
            with torch.no_grad():
                sequences = model.generate(**encoded, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                           max_new_tokens=settings.max_tokens, pad_token_id=tokenizer.pad_token_id,
                                           **stop_options(tokenizer, settings))
            prompt_len = encoded["input_ids"].shape[1]
            completion = sequences[:, prompt_len:]
            # trained tokens: up to the first end-of-sequence token (included); a sequence ended by
            # the stop string is padded after it (pad tokens excluded unless pad is the EOS token)
            is_stop = torch.isin(completion, stops)
            first = torch.where(is_stop.any(1), is_stop.int().argmax(1), completion.shape[1])
            positions_c = torch.arange(completion.shape[1], device=completion.device)[None]
            mask = positions_c <= first[:, None]
            if tokenizer.pad_token_id not in stops.tolist():
                is_pad = completion == tokenizer.pad_token_id
                mask &= positions_c < torch.where(is_pad.any(1), is_pad.int().argmax(1), completion.shape[1])[:, None]
                is_stop = is_stop | is_pad
            mask = mask.long()
            texts_out = [settings.prefix + t for t in
                         tokenizer.batch_decode(completion.masked_fill(mask == 0, tokenizer.pad_token_id),
                                                skip_special_tokens=True)]
        with clock.part("grading"):
            rewards = torch.tensor([reward(text, batch[i // settings.samples]["answer"])
                                    for i, text in enumerate(texts_out)], device=settings.device)
            grouped = rewards.view(settings.problems, settings.samples)
            advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)  # Dr. GRPO: centred, unscaled
        with clock.part("training"):
            model.train()
            attention = torch.cat([encoded["attention_mask"], mask], dim=1)
            positions = (attention.cumsum(1) - 1).clamp(min=0)
            n = sequences.shape[0]
            for start in range(0, n, settings.micro_batch):
                rows = slice(start, start + settings.micro_batch)
                with autocast:
                    logits = model(input_ids=sequences[rows], attention_mask=attention[rows],
                                   position_ids=positions[rows],
                                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
                nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                      completion[rows].reshape(-1), reduction="none").view(logits.shape[:2])
                loss = (advantages[rows, None] * nll * mask[rows]).sum() / (n * settings.max_tokens)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(settings)
        clock.seconds["total"] = time.perf_counter() - begin
        recorder.step(step, clock.seconds, mean_reward=rewards.mean().item(),
                      train_accuracy=(rewards == 1.0).float().mean().item(),
                      truncated_rate=1.0 - is_stop.any(1).float().mean().item(),
                      groups_with_signal=int((grouped.max(1).values > grouped.min(1).values).sum().item()))
        if step in settings.eval_steps():
            evaluate(step)


# ---------------------------------------------------------------------------- (b) TRL

def run_trl(settings: Settings, recorder: Recorder) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if settings.prefix or settings.stop:
        raise SystemExit("trl arm: GRPOTrainer takes no assistant prefix or stop string; "
                         "run it with --prefix '' --stop '' (and a prompt that asks for \\boxed{})")
    torch.manual_seed(settings.seed)
    model, tokenizer = load_model(settings)
    template = Path(settings.prompt).read_text(encoding="utf-8")
    train, heldout = read_jsonl(settings.train), read_jsonl(settings.heldout, settings.heldout_limit)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": fill(template, p["question"])}],
                                  "answer": str(p["answer"])} for p in train])
    completions_per_step = settings.problems * settings.samples
    micro = min(settings.micro_batch, completions_per_step)
    workdir = tempfile.mkdtemp(prefix="parity-trl-")
    config = GRPOConfig(
        output_dir=workdir, loss_type="dr_grpo", scale_rewards="none", beta=0.0,
        learning_rate=settings.lr, lr_scheduler_type="constant", max_steps=settings.steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions_per_step // micro,
        num_generations=settings.samples, max_completion_length=settings.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, seed=settings.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, use_cpu=not settings.cuda, bf16=settings.cuda and settings.trl_bf16,
    )
    clock = Clock(settings)
    step_rewards: list[float] = []

    def reward_fn(completions, answer, **_):
        with clock.part("grading"):
            values = [reward(c[0]["content"] if isinstance(c, list) else c, gold)
                      for c, gold in zip(completions, answer)]
        step_rewards.extend(values)
        return values

    reward_fn.__name__ = "parity_reward"

    class Timing(TrainerCallback):
        def __init__(self):
            self.mark = None

        def on_train_begin(self, args, state, control, model=None, **_):
            self.evaluate(0, model)
            self.mark = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **_):
            sync(settings)
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **_):
            sync(settings)
            clock.seconds["optimizer"] = clock.seconds.get("optimizer", 0.0) + time.perf_counter() - self.optimizer_start

        def on_step_end(self, args, state, control, model=None, **_):
            sync(settings)
            s = clock.seconds
            total = time.perf_counter() - self.mark
            training = s.get("train_step", 0.0) - s.get("prepare", 0.0) + s.get("clip", 0.0) + s.get("optimizer", 0.0)
            recorder.step(state.global_step, {"total": total, "generation": s.get("generation", 0.0),
                                              "grading": s.get("grading", 0.0), "training": training},
                          mean_reward=sum(step_rewards) / max(1, len(step_rewards)),
                          train_accuracy=sum(r == 1.0 for r in step_rewards) / max(1, len(step_rewards)))
            clock.seconds.clear()
            step_rewards.clear()
            if state.global_step in settings.eval_steps():
                self.evaluate(state.global_step, model)
            self.mark = time.perf_counter()

        def evaluate(self, step, model):
            begin = time.perf_counter()
            accuracy = greedy_accuracy(model, tokenizer, heldout, template, settings)
            recorder.evaluation(step, accuracy, time.perf_counter() - begin)

    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timing()])

    def timed(name: str, part: str) -> None:
        original = getattr(trainer, name)

        def wrapper(*args, **kwargs):
            with clock.part(part):
                return original(*args, **kwargs)

        setattr(trainer, name, wrapper)

    trainer.remove_callback(PrinterCallback)  # its per-step log dicts; the recorder prints the steps
    timed("_generate", "generation")
    timed("_prepare_inputs", "prepare")
    timed("training_step", "train_step")
    timed("_clip_grad_norm", "clip")
    recorder.notes.update(trl=trl.__version__, gradient_checkpointing=config.gradient_checkpointing,
                          per_device_train_batch_size=micro,
                          gradient_accumulation_steps=config.gradient_accumulation_steps)
    try:
        trainer.train()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # TRL's output_dir (nothing is saved there)


# ---------------------------------------------------------------------------- (c) sptool run

def keep_records(run_dir: Path, kept: Path) -> None:
    """A copy of ``run_dir``'s step records (``iter-*/*.jsonl``) and ``metrics.jsonl`` under ``kept``
    (no checkpoints)."""
    for path in [*sorted(run_dir.glob("iter-*/*.jsonl")), run_dir / "metrics.jsonl"]:
        if path.is_file():
            target = kept / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def run_sptool(settings: Settings, recorder: Recorder, workdir: Path, arm: str = "sptool") -> None:
    """``sptool run --recipe rlvr`` in a subprocess; per-step seconds from its stage timings and the
    moments its iterations start (stderr). It checkpoints at every evaluation step; accuracies come
    from those checkpoints through :func:`greedy_accuracy`, as for the other arms."""
    run_dir = workdir / "run"
    sets = {
        "rlvr.data": settings.train, "rlvr.problems": settings.problems, "rlvr.samples": settings.samples,
        "rlvr.format_weight": 0.1, "rlvr.keep_equal_groups": True,
        "generation.max_tokens": settings.max_tokens, "generation.temperature": 1.0, "generation.top_p": 1.0,
        "train.loss": "dr_grpo", "train.beta": 0.0, "train.learning_rate": settings.lr,
        "train.max_grad_norm": 1.0, "verify.workers": 8 if settings.cuda else 1,
        "train.max_tokens_per_micro_batch": settings.micro_batch * (settings.max_tokens + 64),
        "model.policy": settings.model, "model.device": settings.device,
        "model.gen_batch_size": settings.problems * settings.samples,
        "verify.require_boxed": True, "prompts.solve": settings.prompt,
        "prompts.solve_prefix": settings.prefix, "prompts.solve_stop": [settings.stop] if settings.stop else [],
        "run.checkpoint_every": settings.eval_every or settings.steps, "run.keep": 0,
        **SPTOOL_ARMS[arm],
    }
    command = [sys.executable, "-m", "sptool.cli.main", "run", "--recipe", "rlvr", "--run-dir", str(run_dir),
               "-n", str(settings.steps), "--seed", str(settings.seed)]
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(value) if isinstance(value, (str, bool, list)) else value}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", **ARM_ENVIRONMENT.get(arm, {}))
    recorder.notes["command"] = " ".join(command)
    if arm in ARM_ENVIRONMENT:
        recorder.notes["environment"] = ARM_ENVIRONMENT[arm]
    starts: dict[int, float] = {}
    done: dict[int, float] = {}  # when each iteration's latest stage finished (its "records in" line)
    began = time.perf_counter()
    with subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                          cwd=ROOT) as process:
        tail: list[str] = []
        for line in process.stderr:
            tail = (tail + [line.rstrip()])[-40:]
            match = re.match(r"\s*iteration (\d+)/\d+", line)
            if match:
                starts[int(match.group(1))] = time.perf_counter()
            elif starts and "records in" in line:
                done[max(starts)] = time.perf_counter()
            if re.search(r"(iteration \d+/|records in|precision)", line):
                print(f"[{arm}] {line.rstrip()}", file=sys.stderr, flush=True)
    ended = time.perf_counter()
    if process.returncode != 0:
        raise RuntimeError(f"sptool run failed (exit {process.returncode}):\n" + "\n".join(tail))
    recorder.notes["process_wall_s"] = ended - began
    config_toml = run_dir / "config.toml"
    if config_toml.is_file():
        recorder.notes["config_precision"] = [line for line in config_toml.read_text().splitlines()
                                              if "precision" in line or line.startswith(("sampler", "trainer",
                                                                                         "reference"))]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kinds = {"solve": "generation", "verify": "grading", "train": "training"}
    for step in range(1, settings.steps + 1):
        mine = [line for line in lines if line.get("iteration") == step]
        # the last step ends with its last stage, not with the process (the final checkpoint's
        # write and the interpreter's exit are no loop step, and TRL's arm is not charged them)
        until = starts.get(step + 1, done.get(step, ended))
        eval_s = sum(line["wall_s"] for line in mine if line["kind"] == "eval")
        seconds = {"total": until - starts[step] - eval_s}
        for line in mine:
            part = kinds.get(line["kind"])
            if part:
                seconds[part] = seconds.get(part, 0.0) + line["wall_s"]
        # the checkpoints are written for the held-out evaluation (every --eval-every steps and the
        # last): the train step's copy for them is shown apart and left out, as the evaluation is
        checkpoint_s = sum(line.get("checkpoint_s") or 0.0 for line in mine if line["kind"] == "train")
        if checkpoint_s:
            seconds.update(total=seconds["total"] - checkpoint_s, checkpoint=checkpoint_s,
                           training=seconds.get("training", 0.0) - checkpoint_s)
        filtered = next((line for line in mine if line["kind"] == "filter"), {})
        means = [v for v in (filtered.get("mean_reward") or {}).values() if v is not None]
        verify = next((line for line in mine if line["kind"] == "verify"), {})
        solve = next((line for line in mine if line["kind"] == "solve"), {})
        trained = next((line for line in mine if line["kind"] == "train"), {})
        update = next(iter((trained.get("roles") or {}).values()), {})
        collecting = [line["gc_s"] for line in mine if line["kind"] != "eval" and line.get("gc_s") is not None]
        recorder.step(step, seconds, mean_reward=means[0] if means else None,
                      gc_s=sum(collecting) if collecting else None,
                      train_accuracy=verify.get("accuracy"), truncated_rate=solve.get("truncated_rate"),
                      **{key: update.get(key) for key in UPDATE_METRICS})
    recorder.notes["stage_wall_s"] = [{k: line.get(k) for k in ("iteration", "stage", "wall_s", "gc_s")}
                                      for line in lines]
    # held-out accuracy from the checkpoints, by the same function as the other arms
    import torch
    from transformers import AutoModelForCausalLM

    template = Path(settings.prompt).read_text(encoding="utf-8")
    heldout = read_jsonl(settings.heldout, settings.heldout_limit)
    model, tokenizer = load_model(settings)
    for step in settings.eval_steps():
        if step:
            found = sorted(run_dir.glob(f"ckpt/*/step-{step:04d}"))
            if not found:
                print(f"[{arm}] no checkpoint for step {step}", file=sys.stderr)
                continue
            model = AutoModelForCausalLM.from_pretrained(found[0], dtype=torch.float32).to(settings.device)
        begin = time.perf_counter()
        recorder.evaluation(step, greedy_accuracy(model, tokenizer, heldout, template, settings),
                            time.perf_counter() - begin)


# ---------------------------------------------------------------------------- report

def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def seed_tag(seed: int) -> str:
    """The file-name tag of one seed's result in a multi-seed run: ``sptool.seed1.json``."""
    return f".seed{seed}"


def load_results(out: Path) -> list[dict]:
    """Every arm result in ``out`` (``ARM.json``, and ``ARM.seedN.json`` of a ``--seeds`` run), in
    :data:`ARMS` order, then by seed; each with ``label`` (the arm, ``ARM s1`` for a seed's)."""
    results = []
    for path in sorted(out.glob("*.json")):
        arm, _, tag = path.stem.partition(".")
        if arm not in ARMS or (tag and not tag.startswith("seed")):
            continue
        data = json.loads(path.read_text())
        data["label"] = f"{arm} s{data['settings']['seed']}" if tag else arm
        results.append(data)
    return sorted(results, key=lambda r: (ARMS.index(r["arm"]), r["settings"]["seed"]))


def heldout_problems(result: dict) -> int | None:
    """The held-out size behind each accuracy (recorded with it; older results: the file's)."""
    for evaluation in result["evals"]:
        if evaluation.get("problems"):
            return int(evaluation["problems"])
    settings = result["settings"]
    for path in (Path(settings["heldout"]), ROOT / "fixtures" / "bench" / Path(settings["heldout"]).name):
        if path.is_file():
            return len(read_jsonl(str(path), settings.get("heldout_limit", 0)))
    return None


def arm_curve(results: list[dict], step: int) -> dict | None:
    """Held-out accuracy of one arm's seeds at ``step``: mean, its standard error and the seeds.

    With two or more seeds the standard error is the seeds' spread, s / √k: it holds the
    trajectory's variance (a rollout or a rounding sends a run down another path), which one
    seed's binomial error, √(p(1 − p) / n) over n held-out problems, cannot show."""
    values = [e["greedy_accuracy"] for r in results for e in r["evals"] if e["step"] == step]
    if not values:
        return None
    k, centre = len(values), sum(values) / len(values)
    if k >= 2:
        spread = math.sqrt(sum((v - centre) ** 2 for v in values) / (k - 1))
        se, kind = spread / math.sqrt(k), "seeds"
    else:
        n = heldout_problems(results[0])
        # p(1 − p) floored at a quarter problem's worth, so that 0 and 1 keep an error
        se, kind = (math.sqrt(max(centre * (1 - centre), 0.25 / n) / n) if n else None), "binomial"
    return {"mean": centre, "se": se, "seeds": k, "values": values, "se_from": kind}


def truncated_shares(by_arm: dict[str, list[dict]], eval_steps: list[int]) -> dict:
    """The share of each arm's samples that ran into the token limit (``truncated_rate`` of its
    step lines) at step 1 and at every evaluation step: a policy that learns to stop says so here
    before its accuracy moves. Per arm the mean over seeds and each seed's value; empty when no
    arm recorded it (TRL's)."""
    steps = sorted({1, *(s for s in eval_steps if s)})
    arms = {}
    for arm, group in by_arm.items():
        rows = {}
        for step in steps:
            values = [s["truncated_rate"] for r in group for s in r["steps"]
                      if s["step"] == step and s.get("truncated_rate") is not None]
            if values:
                rows[step] = {"mean": sum(values) / len(values), "values": values}
        if rows:
            arms[arm] = rows
    return {"steps": steps, "arms": arms} if arms else {}


def against_reference(curves: dict[str, dict[int, dict]], reference: str, steps: list[int]) -> dict:
    """Each arm's mean minus the reference arm's at every evaluation after step 0, with the standard
    error of the difference √(se_arm² + se_ref²); ``within`` is difference ≥ −2 s.e. (issue 32's
    bar: at least the float32 arm − 2 s.e.)."""
    table: dict = {}
    ref = curves.get(reference, {})
    for arm, by_step in curves.items():
        if arm == reference:
            continue
        rows = {}
        for step in steps:
            a, r = by_step.get(step), ref.get(step)
            if not step or a is None or r is None or a["se"] is None or r["se"] is None:
                continue
            diff, se = a["mean"] - r["mean"], math.sqrt(a["se"] ** 2 + r["se"] ** 2)
            rows[str(step)] = {"difference": diff, "se": se, "within": diff >= -2 * se}
        if rows:
            table[arm] = {"steps": rows, "within_everywhere": all(row["within"] for row in rows.values())}
    return table


def report(out: Path, reference: str | None = None) -> str:
    """The table of every arm result in ``out``; writes ``parity.json`` and ``parity.txt``. With
    several seeds of an arm, also its mean and standard error over seeds, and every arm against
    ``reference`` (None: ``sptool-fp32`` when ``out`` has it, else ``sptool``)."""
    results = load_results(out)
    if not results:
        raise SystemExit(f"{out}: no arm results (bare.json, trl.json, sptool.json, sptool.seed1.json ...)")
    if reference is None:
        reference = "sptool-fp32" if any(r["arm"] == "sptool-fp32" for r in results) else "sptool"
    eval_steps = sorted({e["step"] for r in results for e in r["evals"]})
    first = results[0]["settings"]
    seeds = sorted({r["settings"]["seed"] for r in results})
    width = max(30, max(len(r["label"]) for r in results) + 2)
    lines = [f"learning parity: {first['problems']} problems x {first['samples']} samples, "
             f"{first['max_tokens']} new tokens, lr {first['lr']}, device {first['device']}, "
             f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}",
             "", "held-out greedy accuracy after N steps",
             f"{'arm':<{width}}" + "".join(f"{s:>8}" for s in eval_steps)]
    summary: dict = {"settings": first, "arms": {}}
    for r in results:
        by_step = {e["step"]: e["greedy_accuracy"] for e in r["evals"]}
        lines.append(f"{r['label']:<{width}}" + "".join(f"{by_step[s]:>8.3f}" if s in by_step else f"{'-':>8}"
                                                      for s in eval_steps))
    by_arm: dict[str, list[dict]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    curves = {arm: {step: c for step in eval_steps if (c := arm_curve(group, step)) is not None}
              for arm, group in by_arm.items()}
    if any(len(group) > 1 for group in by_arm.values()):
        lines += ["", "mean over seeds (standard error: the seeds' spread s/√k; one seed: binomial)",
                  f"{'arm':<{width}}" + "".join(f"{s:>15}" for s in eval_steps)]
        for arm, by_step in curves.items():
            cells = [f"{c['mean']:.3f} ({c['se']:.3f})" if (c := by_step.get(s)) and c["se"] is not None
                     else "-" for s in eval_steps]
            lines.append(f"{arm + ' (' + str(len(by_arm[arm])) + ')':<{width}}" + "".join(f"{c:>15}" for c in cells))
    compared = against_reference(curves, reference, eval_steps) if reference in curves else {}
    if compared:
        later = [s for s in eval_steps if s]
        lines += ["", f"against {reference}: mean difference (s.e. of the difference); ! below {reference} − 2 s.e.",
                  f"{'arm':<{width}}" + "".join(f"{s:>16}" for s in later) + f"{'within':>8}"]
        for arm, row in compared.items():
            cells = [f"{d['difference']:+.3f} ({d['se']:.3f}){'' if d['within'] else '!'}"
                     if (d := row["steps"].get(str(s))) else "-" for s in later]
            lines.append(f"{arm:<{width}}" + "".join(f"{c:>16}" for c in cells)
                         + f"{'yes' if row['within_everywhere'] else 'no':>8}")
    truncation = truncated_shares(by_arm, eval_steps)
    if truncation:
        rows = {arm: [f"{c['mean']:.2f} ({'/'.join(f'{v:.2f}' for v in c['values'])})" if (c := by_step.get(s))
                      else "-" for s in truncation["steps"]] for arm, by_step in truncation["arms"].items()}
        cell = max(len(c) for cells in rows.values() for c in cells) + 2
        lines += ["", f"share of samples cut at {first['max_tokens']} new tokens, at step 1 and each evaluation step "
                  "(mean over seeds; each seed's in brackets)",
                  f"{'arm':<{width}}" + "".join(f"{s:>{cell}}" for s in truncation["steps"])]
        for arm, cells in rows.items():
            lines.append(f"{arm + ' (' + str(len(by_arm[arm])) + ')':<{width}}" + "".join(f"{c:>{cell}}" for c in cells))
    summary["truncated_share"] = truncation
    lines += ["", "seconds per step (mean over steps 2..N; step 1 includes warm-up), held-out evaluation excluded, "
              "and with it the checkpoints sptool writes for it (ckpt: the train step's copy, not in total)",
              f"{'arm':<{width}}{'step 1':>8}{'total':>8}" + "".join(f"{p:>12}" for p in PARTS)
              + f"{'ckpt':>8}{'eval/call':>11}{'gc':>7}"]
    for r in results:
        later = [s for s in r["steps"] if s["step"] >= 2] or r["steps"]
        row = {key: mean([s.get(key, 0.0) for s in later]) for key in ("total", *PARTS, "checkpoint")}
        row["gc"] = mean([s["gc_s"] for s in later if s.get("gc_s") is not None])
        step1 = r["steps"][0]["total"] if r["steps"] else float("nan")
        eval_s = mean([e["seconds"] for e in r["evals"]]) or 0.0
        lines.append(f"{r['label']:<{width}}{step1:>8.2f}{row['total']:>8.2f}" +
                     "".join(f"{row[p]:>12.2f}" for p in PARTS) + f"{row['checkpoint']:>8.2f}{eval_s:>11.1f}"
                     + f"{'-' if row['gc'] is None else format(row['gc'], '.3f'):>7}")
        summary["arms"][r["label"]] = {"arm": r["arm"], "seed": r["settings"]["seed"],
                                       "accuracy": {str(e["step"]): e["greedy_accuracy"] for e in r["evals"]},
                                       "seconds_per_step": row, "first_step_s": step1, "eval_s": eval_s,
                                       "steps": len(r["steps"]), "notes": r.get("notes", {})}
    summary["mean_over_seeds"] = {arm: {str(step): c for step, c in by_step.items()} for arm, by_step in curves.items()}
    summary["against_reference"] = {"reference": reference, "arms": compared}
    measured = [(r, {key: mean([s[key] for s in r["steps"] if s.get(key) is not None]) for key in UPDATE_METRICS})
                for r in results]
    measured = [(r, row) for r, row in measured if any(v is not None for v in row.values())]
    if measured:
        lines += ["", "updates: ratio π_θ/π_old, clipped share, sampler-trainer log-prob gap |log π_trainer - "
                  "log π_sampler| (nats) and TIS weight; mean over steps (step 1 in brackets: ratio max, gap)",
                  f"{'arm':<{width}}" + "".join(f"{key.replace('logprob_', ''):>15}" for key in UPDATE_METRICS)
                  + f"{'step 1':>20}"]
        for r, row in measured:
            first_step = r["steps"][0] if r["steps"] else {}
            step1 = "/".join(_fmt(first_step.get(key)) for key in ("ratio_max", "logprob_gap"))
            lines.append(f"{r['label']:<{width}}" + "".join(f"{_fmt(row[key]):>15}" for key in UPDATE_METRICS)
                         + f"{'(' + step1 + ')':>20}")
            summary["arms"][r["label"]]["updates"] = row
            summary["arms"][r["label"]]["updates_per_step"] = [
                {"step": s["step"], **{key: s.get(key) for key in UPDATE_METRICS}} for s in r["steps"]]
    text = "\n".join(lines) + "\n"
    (out / "parity.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "parity.txt").write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------- main

def run_workers(jobs: list[tuple[str, list[str]]], parallel: int, retries: int = 0) -> list[str]:
    """Run ``(label, command)`` jobs, at most ``parallel`` at once (a new one starts as soon as any
    ends); the labels of those that failed. A failed job runs again, up to ``retries`` times, once
    every job's first run has ended: jobs that share one GPU mostly fail for its memory, and a
    command that resumes (``sptool run --resume``) goes on from its last finished stage."""
    failed: list[str] = []
    running: list[tuple[str, list[str], int, subprocess.Popen]] = []
    pending = [(label, command, 0) for label, command in jobs]
    again: list[tuple[str, list[str], int]] = []
    while pending or running or again:
        if not pending and not running:
            pending, again = again, []
        while pending and len(running) < max(1, parallel):
            label, command, tries = pending.pop(0)
            print(f"=== {label}" + (f" (again, try {tries + 1})" if tries else ""), file=sys.stderr, flush=True)
            running.append((label, command, tries, subprocess.Popen(command)))
        time.sleep(0.5)
        for job in [job for job in running if job[3].poll() is not None]:
            running.remove(job)
            label, command, tries, process = job
            if process.returncode == 0:
                continue
            if tries < retries:
                print(f"=== {label} failed (exit {process.returncode}); it runs again once the others have ended",
                      file=sys.stderr, flush=True)
                again.append((label, command, tries + 1))
            else:
                failed.append(label)
    return failed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="sptool,sptool-fp32,bare,trl", help=f"comma-separated: {', '.join(ARMS)}")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--task", default="sums", choices=sorted(TASKS),
                        help="sums: two-digit sums, zero-shot prompt (default); small: sums of 2..19, few-shot, "
                             "prefix and stop")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--problems", type=int, default=None, help="problems per step (cpu 2, cuda 64)")
    parser.add_argument("--samples", type=int, default=None, help="samples per problem (cpu 2, cuda 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens (cpu 8, cuda 64)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default=None, help="comma-separated: every arm once per seed (results "
                        "ARM.seedN.json); the report adds each arm's mean and standard error over its seeds "
                        "and every arm against --reference")
    parser.add_argument("--reference", default=None, help="the arm the others are held against "
                        "(mean difference and its standard error at every evaluation; default sptool-fp32 "
                        "when it runs, the float32 line issue 32 holds the default to, else sptool)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--heldout-limit", type=int, default=None, help="first N held-out problems (cpu 4, cuda all)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (cuda 128)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt", default=None, help="solver prompt template file ({question}); default the task's")
    parser.add_argument("--prefix", default=None, help="assistant reply prefix (every arm); default the task's")
    parser.add_argument("--stop", default=None, help="stop string ('' for none); default the task's")
    parser.add_argument("--train", default=None, help="training problems (JSONL question, answer); default the task's")
    parser.add_argument("--heldout", default=None, help="held-out problems (JSONL question, answer); default the task's")
    parser.add_argument("--bare-bf16", action="store_true", help="the bare loop's training forward under bf16 autocast")
    parser.add_argument("--trl-bf16", action="store_true", help="TRL with bf16=True")
    parser.add_argument("--parallel", type=int, default=1, help="arms run at once (learning curves only)")
    parser.add_argument("--retries", type=int, default=0, help="a failed arm runs again up to N times, once "
                        "the others have ended (arms sharing a GPU mostly fail for its memory)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results/parity-DEVICE)")
    parser.add_argument("--report", default=None, metavar="DIR", help="only print the table of DIR")
    parser.add_argument("--keep-records", action="store_true",
                        help="sptool arms: keep each step's records and metrics.jsonl of the run under "
                        "OUT/ARM.run/ (the run directory is otherwise temporary), e.g. to time grading on them")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    pick = lambda value, gpu, cpu: value if value is not None else (gpu if cuda else cpu)  # noqa: E731
    task = TASKS[args.task]
    given = lambda value, key: value if value is not None else (  # noqa: E731
        str(ROOT / task[key]) if key in ("train", "heldout", "prompt") else task[key])
    problems, samples = pick(args.problems, 64, 2), pick(args.samples, 8, 2)
    return Settings(device=device, steps=args.steps, problems=problems, samples=samples,
                    max_tokens=pick(args.max_tokens, 64, 8), lr=args.lr, seed=args.seed,
                    eval_every=args.eval_every, micro_batch=pick(args.micro_batch, 128, problems * samples),
                    model=args.model, task=args.task, heldout_limit=pick(args.heldout_limit, 0, 4),
                    prompt=given(args.prompt, "prompt"), prefix=given(args.prefix, "prefix"),
                    stop=given(args.stop, "stop"), train=given(args.train, "train"),
                    heldout=given(args.heldout, "heldout"), bare_bf16=args.bare_bf16, trl_bf16=args.trl_bf16)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(Path(args.report), args.reference), end="")
        return 0
    settings = settings_from(args)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"parity-{settings.device.split(':')[0]}")
    if args.worker:  # one arm in this process
        import warnings

        warnings.filterwarnings("ignore")
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        recorder = Recorder(args.worker, settings, args.tag)
        recorder.out = out
        if args.worker == "bare":
            run_bare(settings, recorder)
        elif args.worker == "trl":
            run_trl(settings, recorder)
        else:
            with tempfile.TemporaryDirectory(prefix="parity-sptool-") as workdir:
                try:
                    run_sptool(settings, recorder, Path(workdir), args.worker)
                finally:
                    if args.keep_records:
                        keep_records(Path(workdir) / "run", out / f"{args.worker}{args.tag}.run")
        recorder.save(out)
        return 0
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    try:
        seeds = [int(item) for item in args.seeds.split(",") if item.strip()] if args.seeds else []
    except ValueError:
        raise SystemExit(f"--seeds: comma-separated integers, not {args.seeds!r}") from None
    if args.reference is not None and args.reference not in ARMS:
        raise SystemExit(f"--reference: unknown arm {args.reference!r}; choose from {', '.join(ARMS)}")
    base = list(argv if argv is not None else sys.argv[1:])
    # each arm (and seed) in its own process: same start, no state shared between arms
    common = ["--device", settings.device, "--out", str(out)]
    if seeds:
        jobs = [(f"{arm} seed {seed}", [sys.executable, __file__, *base, "--worker", arm, "--seed", str(seed),
                                        "--tag", seed_tag(seed), *common]) for seed in seeds for arm in arms]
    else:
        jobs = [(arm, [sys.executable, __file__, *base, "--worker", arm, *common]) for arm in arms]
    failed = run_workers(jobs, args.parallel, args.retries)
    print(report(out, args.reference), end="")
    if failed:
        print(f"failed arms: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
