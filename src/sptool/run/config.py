"""The configuration sections every recipe shares, as typed dataclasses: one declaration per key
with its default, help text, source and range (see :func:`sptool.settings.setting`).

A recipe's own section is its ``Config`` dataclass (``recipes/wist.py`` …), which extends the
recipe's filter options (``sptool.filter``), so a filter setting is declared once and reachable
with ``--set``. The recipe schema, ``recipes show --explain``, the range checks and
``sptool run``'s option help are all derived from these classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sptool.settings.limits import DTYPES, _backends, _objectives, device_error
from sptool.settings import setting


def train_default(name: str) -> Any:
    """``train-step``'s own default for one setting (``TrainConfig``), so it is written once."""
    from sptool.train.step import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[name]


@dataclass
class RunConfig:
    iterations: int = setting(1, "outer iterations (WIST: rollouts; R-Zero/R-Quest: rounds, after R-Quest's "
                              "validity initialisation as iteration 0)",
                              minimum=1)
    seed: int = setting(0, "run seed; each step's seed derives from (seed, iteration, step)")
    keep: int = setting(3, "checkpoints kept per role (0: all)", minimum=0)
    checkpoint_every: int = setting(10, "write checkpoints after every N-th iteration and the last one; "
                                    "a resumed run replays the train steps since the newest one",
                                    minimum=1)
    stop_on_collapse: bool = setting(False, "a crossed health.* threshold stops the run (exit 3, "
                                     "resumable; thresholds may change on --resume)")
    gc_freeze: bool = setting(True, "after the first iteration, exempt every object made so far (the "
                              "models, compiled graphs, imports) from Python's cyclic garbage collector "
                              "(gc.freeze), so that its full collections scan only what later steps make")


@dataclass
class ModelConfig:
    policy: str = setting("tiny", "starting weights: HF id, local HF directory, or tiny")
    backend: str = setting("hf", "generation backend: hf (shares weights with the trainer), scripted, "
                           "vllm, openai", choices=_backends)
    script: str = setting("", "scripted backend: the JSONL script file")
    questioner: str = setting("", "two-role recipes: the questioner's start (HF id, directory or "
                              "checkpoint); empty: model.policy",
                              "R-Quest §3.1: the questioner starts from the base model")
    solver: str = setting("", "two-role recipes: the solver's start; empty: model.policy. R-Quest: a "
                          "solver given here is taken as initialised (no validity initialisation)",
                          "R-Quest App. A.3: the initialised solver is the self-play solver's start")
    judge: str = setting("", "R-Quest's frozen novelty judge; empty: model.policy",
                         "R-Quest §3: judged by the frozen base model")
    device: str = setting("", "cpu, cuda, cuda:1 …; empty: a GPU when there is one", validate=device_error)
    dtype: str = setting("", "generation precision: auto, bf16, fp16, fp32 (hf sharing the trainer's float32 "
                         "policy: fp32 unless set; a separately loaded model: bf16 on GPU); empty: auto",
                         choices=("", *DTYPES))
    gen_batch_size: int = setting(64, "sequences per forward batch (hf backend)", minimum=1)
    chat_template: bool = setting(True, "prompt through the tokenizer's chat template")
    compile_generation: bool = setting(True, "hf backend on CUDA: decode through a static KV cache with "
                                       "a compiled step (CUDA graphs), batch shapes bucketed; ignored "
                                       "on CPU (eager decoding)")
    decoder: str = setting("generate", "hf backend: generate (transformers' generate) or step (sptool's "
                           "step decoder: one prefill per distinct prompt, a sampling step without host "
                           "syncs, compiled whole on CUDA with compile_generation; falls back to "
                           "generate for a model it can't run)", choices=("generate", "step"))
    decode_attention: str = setting("model", "hf backend: attention while decoding: model (the model's "
                                    "own, SDPA) or grouped (one decoding position against the KV cache as "
                                    "a grouped-query matmul: keys and values read once, no repeat_kv "
                                    "copy; prefill and training keep SDPA)", choices=("model", "grouped"))
    step_graph: str = setting("compile", "hf backend, the step decoder on CUDA: how its compiled step becomes "
                              "a CUDA graph: compile (torch.compile's reduce-overhead graphs) or capture "
                              "(sptool captures each KV cache's step once: a token is one graph replay, "
                              "without dynamo's guards and input copies)", choices=("compile", "capture"))
    base_url: str = setting("", "openai backend: server URL(s), comma-separated (--base-url; `sptool "
                            "serve` starts one); empty: $SPTOOL_BASE_URL or http://127.0.0.1:8000/v1")


@dataclass
class GenerationConfig:
    temperature: float = setting(1.0, "sampling temperature", minimum=0)
    top_p: float = setting(1.0, "nucleus sampling mass", above=0, maximum=1)
    max_tokens: int = setting(512, "new tokens per generation (also Dr. GRPO's normaliser L)",
                              minimum=1)
    prompts_per_call: int = setting(4, "challenge prompts (WIST documents, SvS solutions) per generate "
                                    "call; solve and eval fill model.gen_batch_size instead", minimum=1)


@dataclass
class TrainSection:
    loss: str = setting(train_default("loss"), "policy objective (dr_grpo, grpo, dapo)", choices=_objectives)
    learning_rate: float = setting(train_default("learning_rate"), "optimizer learning rate", above=0)
    beta: float = setting(train_default("beta"), "KL coefficient to the reference policy", minimum=0)
    max_grad_norm: float = setting(train_default("max_grad_norm"), "gradient clipping norm (0: no clipping)")
    lora_r: int = setting(train_default("lora_r"), "LoRA rank (0: full fine-tuning)", minimum=0)
    max_tokens_per_micro_batch: int = setting(train_default("max_tokens_per_micro_batch"),
                                              "tokens per micro-batch (gradient accumulation)", minimum=1)
    mixed_precision: str = setting("auto", "autocast precision of the trainer's forwards (master weights "
                                   "and optimizer stay float32): auto (bf16 on CUDA, with weight_rounding "
                                   "stochastic and old_logprobs trainer: it learnt at the float32 rate on "
                                   "an H200; no on CPU), no (float32), bf16, fp16 (with a gradient scaler)",
                                   choices=("auto", "no", "bf16", "fp16"))
    old_logprobs: str = setting(train_default("old_logprobs"), "where the update's log π_old comes from: "
                                "sampler (the log-probs the generator recorded) or trainer (the trainer's "
                                "own forward in its own precision: a rollout's first update has ratio 1; "
                                "the sampler's log-probs then feed only the gap metric and tis_cap); auto: "
                                "trainer under bf16/fp16 or with tis_cap, else sampler",
                                choices=("auto", "sampler", "trainer"))
    tis_cap: float = setting(train_default("tis_cap"), "truncated importance sampling: each token's "
                             "policy-gradient term times min(exp(log π_trainer − log π_sampler), tis_cap); "
                             "0: off; needs old_logprobs = \"trainer\"", minimum=0)
    fp32_head: bool = setting(train_default("fp32_head"), "under bf16 or fp16 autocast, the LM head's matmul and "
                              "log-softmax in float32 (the body stays in the autocast precision)")
    tf32: bool = setting(train_default("tf32"), "float32 matmuls on TF32 tensor cores (CUDA): float32 "
                         "weights and accumulation, products with a 10-bit mantissa; the whole process, "
                         "the sampler too")
    weight_rounding: str = setting(train_default("weight_rounding"), "how a bf16/fp16 trainer's forward "
                                   "rounds the float32 master weights: nearest (autocast's cast: an RL-sized "
                                   "update below half a rounding step is invisible to it), split (hi + lo, one "
                                   "more matmul per linear: every update seen), stochastic (bf16: an unbiased "
                                   "stochastically rounded copy each forward, no extra matmul); auto: "
                                   "stochastic under bf16, else nearest",
                                   choices=("auto", "nearest", "split", "stochastic"))
    compile: bool = setting(True, "torch.compile the decoder layers and log-prob kernels on CUDA "
                            "(false: eager; never on CPU)")
    start_optimizer: str = setting("fresh", "the optimizer of a role whose model is another run's "
                                   "checkpoint (model.policy / solver / questioner = CKPT): fresh AdamW "
                                   "moments, or restore that run's (its moments keep moving the weights "
                                   "along its own objective for some ten steps, whatever this run's "
                                   "rewards). A resumed run always restores its own",
                                   "sptool's choice (a label-free arm from an rlvr start gained as much "
                                   "under random labels with restored moments)", choices=("fresh", "restore"))
    shared_policy: bool = setting(True, "one policy plays every role (WIST, SvS), else questioner and "
                                  "solver are trained apart (R-Zero, R-Quest)")


@dataclass
class VerifyConfig:
    workers: int = setting(2, "grading processes", minimum=1)
    deadline_s: float = setting(30.0, "seconds before a stuck grading is abandoned", above=0)
    require_boxed: bool = setting(False, "grade only an answer inside \\boxed{} (else math-verify's "
                                  "extraction too)")
    vote: str = setting("auto", "the majority vote: auto = only where it is the label (pseudo-labels, "
                        "no reference answer); always = beside a reference too (majority_frac in the "
                        "metrics, at O(k²) math-verify comparisons a question)", choices=("auto", "always"))


PRESET_CHOICES = ("", "gsm8k", "math", "aime", "numina")  # sptool.stages.problemsets.columns.PRESETS, kept light here


@dataclass
class DataConfig:
    preset: str = setting("", "the training set's (--data) column layout: gsm8k ('#### N' answer line), "
                          "math (last \\boxed{} of solution), aime (integer answer), numina; empty: "
                          "question, answer", choices=PRESET_CHOICES)
    question_field: str = setting("", "the training set's column holding the problem (empty: the preset's, "
                                  "else question)")
    answer_field: str = setting("", "the training set's column holding the reference answer (empty: the "
                                "preset's, else answer)")


@dataclass
class EvalConfig:
    benchmarks: str = setting("", "held-out problem sets (JSONL, parquet, JSON, CSV, a datasets directory, "
                              "hf:NAME[:CONFIG][@SPLIT]), comma-separated; empty: off")
    preset: str = setting("", "the held-out sets' column layout (as data.preset); empty: question, answer",
                          choices=PRESET_CHOICES)
    every: int = setting(0, "also evaluate after every N-th iteration (0: before and after only)",
                         minimum=0)
    samples: int = setting(4, "sampled solutions per problem (mean@k, pass@k); greedy is extra; "
                           "0: greedy only", minimum=0)
    max_tokens: int = setting(0, "new tokens per solution (0: generation.max_tokens)", minimum=0)


@dataclass
class DecontaminateConfig:
    benchmarks: str = setting("", "benchmark JSONL files (question, id), comma-separated, screened out of "
                              "every generated question and WIST document; empty: off")
    ngram: int = setting(13, "a shared run of this many normalised words marks a copy", minimum=1)
    minhash_threshold: float = setting(0.7, "MinHash Jaccard (word pairs) of a near-copy; 0: n-grams only",
                                       minimum=0, maximum=1)


@dataclass
class HealthConfig:
    probe: str = setting("", "labelled probe JSONL (question, answer) for pseudo-label accuracy; "
                         "empty: off (also --probe)")
    probe_samples: int = setting(8, "solver samples per probe question (the vote)", minimum=1)
    min_valid_rate: float = setting(0.0, "warn (stop with run.stop_on_collapse) below this "
                                    "valid-question rate", minimum=0, maximum=1)
    max_duplicate_share: float = setting(1.0, "warn (stop with run.stop_on_collapse) above this share of "
                                         "near-duplicate questions",
                                         minimum=0, maximum=1)
    min_signal_share: float = setting(0.0, "warn (stop with run.stop_on_collapse) below this share of "
                                      "groups with a learning signal",
                                      minimum=0, maximum=1)
    min_pseudo_label_accuracy: float = setting(0.0, "warn (stop with run.stop_on_collapse) below this "
                                               "pseudo-label accuracy on the probe",
                                               minimum=0, maximum=1)


COMMON_SECTIONS: dict[str, type] = {
    "run": RunConfig, "model": ModelConfig, "generation": GenerationConfig, "train": TrainSection,
    "verify": VerifyConfig, "decontaminate": DecontaminateConfig, "health": HealthConfig,
    "eval": EvalConfig, "data": DataConfig,
}


def section_defaults(cls: type) -> dict[str, Any]:
    """A section's defaults as plain TOML/JSON values (tuples as lists)."""
    return {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
            for f in dataclasses.fields(cls)}


def section_object(cls: type, values: dict[str, Any]) -> Any:
    """A section dataclass from its (validated) dict (lists as tuples)."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class Sections:
    """The shared sections of one run's configuration, typed (``settings.model.backend``)."""

    run: RunConfig
    model: ModelConfig
    generation: GenerationConfig
    train: TrainSection
    verify: VerifyConfig
    decontaminate: DecontaminateConfig
    health: HealthConfig
    eval: EvalConfig
    data: DataConfig

    @classmethod
    def of(cls, config: dict) -> "Sections":
        return cls(**{name: section_object(kind, config[name]) for name, kind in COMMON_SECTIONS.items()})

    def train_options(self) -> dict[str, Any]:
        """The ``[train]`` keys that are ``train-step`` settings (all but ``shared_policy`` and
        ``start_optimizer``, which :class:`~sptool.run.session.Policy` turns into ``restore_optimizer``)."""
        options = {f.name: getattr(self.train, f.name) for f in dataclasses.fields(self.train)
                   if f.name not in ("shared_policy", "start_optimizer")}
        options["mixed_precision"] = None if options["mixed_precision"] == "auto" else options["mixed_precision"]
        if options.pop("compile"):
            options["compile"] = options["compile_kernels"] = None  # on CUDA
        else:
            options["compile"] = options["compile_kernels"] = False
        return options
