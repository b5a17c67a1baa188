"""Self-play in miniature: does a label-free recipe make the tiny model better at held-out sums?

One command runs every arm on one GPU (four at a time: an R-Zero arm holds two models and their
decoding caches, 20-40 GB) and measures each the same way: held-out greedy accuracy on 300
two-digit sums no training set holds
(``fixtures/bench/addition_heldout_300.jsonl``, the zero-shot prompt of ``learning_parity.py``,
the strict grader: the last ``\\boxed{}``, its part after the last "=", must be the number),
evaluated by ``sptool run`` itself before the first round and after every round (``--eval``,
``verify.require_boxed``), and again by :func:`learning_parity.greedy_accuracy` on each arm's last
checkpoint, as a check that the two graders agree.

1. **The start.** The base model scores 0 zero-shot, and a label-free recipe cannot bootstrap
   from a solver that never answers. ``sptool run --recipe rlvr`` trains it with labels for
   ``--start-steps`` steps (64 × 8, 64 new tokens, lr 1e-5, Dr. GRPO: the parity settings), to
   about 0.3-0.5 held-out; every other arm starts from that checkpoint.
2. **The arms**, each ``--rounds`` rounds from the start, one process each, seeds ``--seeds``:

   - ``rzero``: R-Zero, label-free. The questioner (from the start too, with the packaged ``sums``
     prompt: it writes ``What is A + B?``) is trained on the uncertainty reward with the BLEU
     penalty; the solver on its questions against majority-vote pseudo-labels (band 0.3-0.8);
   - ``rquest``: R-Quest, label-free: R-Zero plus the validity initialisation (from the start), the
     validity gate, the novelty gate (lexical: the 135M judge answers one word for every pair) and
     the replay of the initialisation set;
   - ``shuffled``: the control for both: R-Zero whose pool labels are the same majority answers
     permuted among the pool's questions (``rzero.pool_labels=shuffled``). If it gains as much,
     the gain is not the vote's;
   - ``rlvr``: the same number of solver updates with the true labels (the upper line);
   - ``svs``: SvS, labels for the originals, variational problems from the solver's own correct
     answers; compared with ``rlvr`` on pass@k and the policy's entropy;
   - ``wist``: WIST from the start on ``--wist-domain``: ``arithmetic`` (nine leaves from one-digit
     sums to two-digit products, ten local pages each, written to ``OUT/data/arithmetic/``) or
     ``mathematics`` (the packaged tree, titles and offline pages, ``local:package:web``: run 4); the
     challenger writing a question from a page, the solver's agreement with it as the learnability
     that updates the leaves' posteriors;
   - ``wist-uniform``: its control, paths drawn with every child equally likely
     (``wist.path_rule=uniform``): does the posterior send the paths where the solver improves?
   - ``start``: the start evaluated again (greedy: the same number every time; it is the line the
     others are measured from).

3. **Per round**, from each run directory: held-out greedy (and pass@k where sampled), the solver
   pool's size and its pseudo-label accuracy (a sum's truth is computable from the question), the
   questioner's well-formed rate (a proposal parsed into a question), its *valid* rate (a
   well-formed ``A + B`` question), its *well-posed* rate (``What is EXPR?`` with closed arithmetic: one answer), R-Quest's validity-gate and novelty-gate pass rates, and the
   policy entropy and reward of the solver's updates; for WIST, per leaf: its questions, the
   solver's mean agreement p̂ with the challenger, and the leaf's posterior mean.

Results: ``OUT/<arm>-s<seed>.json`` per arm, ``OUT/selfplay.json`` and ``OUT/selfplay.md`` (the
tables, standard errors, and the issue's targets checked).

    python benchmarks/selfplay.py --device cuda --out DIR                      # every arm, seeds 1,2
    python benchmarks/selfplay.py --device cuda --arms rzero,shuffled --seeds 1,2,3 --start DIR/start
    python benchmarks/selfplay.py --report DIR
    python benchmarks/selfplay.py --device cpu --out DIR                       # smoke test (tiny budgets)

On CPU everything shrinks to a smoke test: a 1-step start, one round of the ``rzero`` and
``shuffled`` arms, 8 new tokens and 4 held-out problems.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

ARMS = ("start", "rlvr", "rzero", "rquest", "shuffled", "svs", "wist", "wist-uniform")
LABEL_FREE = ("rzero", "rquest", "shuffled")
SUM = re.compile(r"^\s*What is (-?\d+)\s*\+\s*(-?\d+)\s*\?\s*$")


@dataclass
class Settings:
    device: str
    rounds: int            # self-play rounds per arm
    start_steps: int       # rlvr steps that make the start
    solver_steps: int      # solver updates per round (rlvr and svs: as many iterations in all)
    problems: int          # questions per update (solver batch)
    samples: int           # rollouts per question (the update's group); also the vote's m
    questions: int         # questioner proposals per questioner update
    pool: int              # candidates proposed per round for the solver's pool
    max_tokens: int
    lr: float
    heldout_limit: int
    pass_k: int            # sampled solutions per held-out problem for pass@k (rlvr, svs); 0: off
    gen_batch: int = 1024  # sequences per generate call (the compiled decoder's caches grow with it)
    decoder: str = "generate"  # model.decoder of every arm (step: the step decoder, issue 33)
    decode_attention: str = "model"  # model.decode_attention of every arm (grouped: issue 33)
    mixed_precision: str = "auto"  # train.mixed_precision of every arm and the start (runs 1-5: float32, "no")
    band: list | None = None  # the solver pool's p̂ band of the label-free arms (None: R-Quest's 0.3-0.8 on cuda)
    format_weight: float = 0.1  # every arm's credit for a readable \boxed{} answer (the start keeps 0.1)
    # R-Quest's novelty gate on sums: "repeat" (only a repeated question is the same) or "template"
    # (numbers masked, similarity >= 0.6, runs 1-6: every sum is one task type, so no sum was novel)
    rquest_novelty: str = "repeat"
    # WIST's domain: "arithmetic" (leaves from one-digit sums to two-digit products, local pages) or
    # "mathematics" (the packaged tree and sample pages: run 4, where g was 1 for 2-12% of questions)
    wist_domain: str = "arithmetic"
    wist_data: str = ""  # the arithmetic domain's tree, titles and pages (OUT/data/arithmetic)
    model: str = "tiny"
    validity_init: str = ""  # R-Quest's validity-initialisation set (OUT/data/, see validity_init_set)
    train: str = str(ROOT / "fixtures/addition_train.jsonl")
    heldout: str = str(ROOT / "fixtures/bench/addition_heldout_300.jsonl")
    prompt: str = str(ROOT / "benchmarks/prompt_zero_shot.txt")

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def defaults(device: str) -> dict:
    if device.startswith("cuda"):
        return dict(rounds=5, start_steps=10, solver_steps=3, problems=64, samples=8, questions=64, pool=512,
                    max_tokens=64, heldout_limit=0, pass_k=16)
    return dict(rounds=1, start_steps=1, solver_steps=1, problems=2, samples=2, questions=4, pool=4,
                max_tokens=8, heldout_limit=4, pass_k=0)


# ---------------------------------------------------------------------------- the arms' settings

def common_sets(s: Settings) -> dict:
    """What every arm shares: sampling, objective, grader, prompt, the held-out evaluation."""
    return {
        "generation.max_tokens": s.max_tokens, "generation.temperature": 1.0, "generation.top_p": 1.0,
        "train.loss": "dr_grpo", "train.beta": 0.0, "train.learning_rate": s.lr, "train.max_grad_norm": 1.0,
        # 4096 tokens a micro-batch (gradient accumulation: the same update). At 16,384 (the first
        # runs) an R-Zero process held about 30 GB and R-Quest ran out of memory beside 4 of them;
        # the float32 activations kept for backward are most of it by estimate (30 layers x ~20
        # saved tensors x 16,384 tokens x 576 x 4 bytes, about 22 GB)
        "train.max_tokens_per_micro_batch": 4096,
        # every arm starts new AdamW moments from the start checkpoint (run 4: restored moments carried
        # the labelled start's direction into the label-free arms, and the random-label control gained)
        "train.start_optimizer": "fresh",
        "model.device": s.device, "model.gen_batch_size": s.gen_batch if s.cuda else 16, "model.decoder": s.decoder,
        "model.decode_attention": s.decode_attention, "train.mixed_precision": s.mixed_precision,
        "verify.workers": 2 if s.cuda else 1, "verify.require_boxed": True,
        "prompts.solve": s.prompt, "prompts.solve_prefix": "", "prompts.solve_stop": [],
        "eval.benchmarks": s.heldout, "eval.every": 1, "eval.samples": 0,
        "run.checkpoint_every": 1000, "run.keep": 1,
    }


def round_sets(s: Settings, section: str) -> dict:
    """R-Zero's and R-Quest's round at this scale (the paper's band and format weight)."""
    return {f"{section}.{key}": value for key, value in {
        "questions": s.questions, "questioner_group": 4, "samples": s.samples, "questioner_steps": 1,
        "solver_steps": s.solver_steps, "solver_questions": s.pool, "solver_batch": s.problems,
        "solver_rollouts": s.samples, "solver_band": s.band or ([0.3, 0.8] if s.cuda else [0.0, 1.0]),
        "format_weight": s.format_weight}.items()} | {"prompts.questioner": "sums"}


def arm_plan(arm: str, s: Settings, start: str) -> tuple[str, int, dict]:
    """``(recipe, iterations, --set values)`` of one arm, from the start checkpoint ``start``."""
    sets = common_sets(s)
    if arm == "rlvr":
        return "rlvr", s.rounds * s.solver_steps, {
            **sets, "model.policy": start, "rlvr.data": s.train, "rlvr.problems": s.problems,
            "rlvr.samples": s.samples, "rlvr.format_weight": s.format_weight, "rlvr.keep_equal_groups": True,
            "eval.every": s.solver_steps, "eval.samples": s.pass_k}
    if arm == "svs":
        return "svs", s.rounds * s.solver_steps, {
            **sets, "model.policy": start, "svs.data": s.train, "svs.problems": s.problems,
            "svs.samples": s.samples, "svs.variants": 2, "svs.max_solutions": 1, "svs.format_weight": s.format_weight,
            "prompts.synthesis": "solutions-short", "eval.every": s.solver_steps, "eval.samples": s.pass_k}
    if arm in ("rzero", "shuffled"):
        extra = {"rzero.pool_labels": "shuffled"} if arm == "shuffled" else {}
        return "rzero", s.rounds, {**sets, **round_sets(s, "rzero"), **extra,
                                   "model.solver": start, "model.questioner": start}
    if arm == "rquest":
        # model.policy (not model.solver): the validity initialisation runs from the start
        return "rquest", s.rounds, {
            **sets, **round_sets(s, "rquest"), "model.policy": start, "rquest.validity_samples": 3,
            "rquest.novelty_judge": "lexical", "rquest.novelty_k": 3, "rquest.init_steps": 3,
            **({"rquest.novelty_similarity": 1.0, "rquest.novelty_mask_numbers": False}
               if s.rquest_novelty == "repeat" else {}),
            "rquest.init_batch": 16, "rquest.init_samples": s.samples, "prompts.validity": "direct",
            **({"rquest.init_data": s.validity_init} if s.validity_init else {})}
    if arm in ("wist", "wist-uniform"):
        return "wist", s.rounds, {**sets, **wist_sets(s), "model.policy": start,
                                  "wist.path_rule": "uniform" if arm == "wist-uniform" else "thompson"}
    raise ValueError(arm)


def wist_sets(s: Settings) -> dict:
    """WIST at this scale: the domain's tree, titles and pages (offline: ``--wist-domain``), ``questions``
    paths of G = K = ``samples``, as many completions per update as make ``solver_steps`` updates a round."""
    paths = s.questions if s.cuda else 2
    completions = paths * 2 * s.samples  # challenger candidates + solver samples of the drawn QAs, at most
    if s.wist_domain == "arithmetic":
        data = Path(s.wist_data)
        domain = {"tree": str(data / "tree.json"), "titles": str(data / "titles.txt"),
                  "search": f"local:{data / 'pages.jsonl'}", "query_from": "leaf",
                  "min_question_chars": 12}  # Γ's default 20 refused "What is 89 + 14?" (16)
        # the reply starts inside "<question>What is " (as R-Zero's sums questioner): the 135M model
        # copied documents-short's example question about hexagons onto the arithmetic pages
        challenger = {"prompts.challenger": str(data / "challenger.txt"), "prompts.challenger_prefix": "<question>What is ",
                      "prompts.challenger_stop": ["?", "</question>"],
                      "prompts.challenger_answer_prefix": "</question>\n\\boxed{",
                      "prompts.challenger_answer_stop": ["}"], "prompts.challenger_answer_max_tokens": 8}
    else:  # run 4: the packaged mathematics tree and sample pages
        domain = {"tree": "package:tree.json", "titles": "package:titles.txt", "search": "local:package:web",
                  "query_from": "path"}
        challenger = {"prompts.challenger": "documents-short"}
    return {f"wist.{key}": value for key, value in {
        **domain, "encoder": "none", "min_chars": 200, "paths": paths, "candidates": s.samples,
        "samples": s.samples, "max_document_chars": 600, "expand_max_tokens": 16, "max_attempts": 1,
        "train_batch": -(-completions // s.solver_steps)}.items()} | challenger


#: WIST's arithmetic domain (``--wist-domain arithmetic``): leaf → (operation, digits of a, digits
# of b), from what the start answers to what it cannot. On run 4's mathematics tree the 135M solver
# agreed with the challenger on 2-15% of its samples on every leaf, so g = 1(p̂(1 − p̂) ≥ τ_var) was
# 1 for 2-12% of questions and every posterior stayed near Beta(1, 6): nothing to steer by. Here the
# leaves span the learnability band, and the held-out kind (two-digit sums) is one leaf among nine
ARITHMETIC_LEAVES = {
    "Addition": {"One-digit addition": ("+", 1, 1), "Two-digit addition": ("+", 2, 2),
                 "Three-digit addition": ("+", 3, 3)},
    "Subtraction": {"One-digit subtraction": ("-", 1, 1), "Two-digit subtraction": ("-", 2, 2),
                    "Three-digit subtraction": ("-", 3, 3)},
    "Multiplication": {"Multiplication table": ("*", 1, 1), "Multiplying by one digit": ("*", 2, 1),
                       "Two-digit multiplication": ("*", 2, 2)},
}
#: the arithmetic challenger's prompt: its example is a division, a kind no leaf has, so a copied
# example is told apart from a question about the page
ARITHMETIC_CHALLENGER = """Read the text below, then write one arithmetic question that uses numbers from it, and its answer.

Example:
Text: Division. Dividing splits a number into equal parts. For example, 84 divided by 4 is 21.
<question>What is 84 / 4?</question>
\\boxed{21}

Text: {text}
"""
ARITHMETIC_MAX_CHILDREN = 3  # children of every inner node: the tree is full
PAGES_PER_LEAF = 10  # = corpus fetch's results per query: a leaf's search returns its own pages
OPERATION_WORDS = {"+": ("plus", "add", "sum"), "-": ("minus", "subtract", "difference"),
                   "*": ("times", "multiply", "product")}


def arithmetic_page(leaf: str, operation: str, digits: tuple[int, int], rng, exclude: set) -> str:
    """One page of ``leaf``: what the operation is, then worked examples in words and symbols, none of
    them a pair of ``exclude`` (the held-out sums): what a textbook page on the topic says."""
    word, verb, noun = OPERATION_WORDS[operation]
    intro = rng.choice([
        f"{leaf} is a topic of elementary arithmetic. To {verb} two numbers, work from the ones digit to the left.",
        f"This page is about {leaf.lower()}. The {noun} of two numbers is found one digit at a time, from the right.",
        f"In {leaf.lower()}, we {verb} a number with {digits[0]} digits and a number with {digits[1]} digits.",
    ])
    sentences = [f"{leaf}.", intro, "Here are some worked examples."]
    while len(sentences) < 9:
        a = rng.randint(10 ** (digits[0] - 1) if digits[0] > 1 else 1, 10 ** digits[0] - 1)
        b = rng.randint(10 ** (digits[1] - 1) if digits[1] > 1 else 1, 10 ** digits[1] - 1)
        if operation == "-" and b > a:
            a, b = b, a
        if (operation, a, b) in exclude:
            continue
        value = {"+": a + b, "-": a - b, "*": a * b}[operation]
        sentences.append(rng.choice([
            f"For example, {a} {word} {b} is {value}.",
            f"If we {verb} {a} and {b}, the answer is {value}, so {a} {operation} {b} = {value}.",
            f"The {noun} of {a} and {b} is {value}.",
            f"What is {a} {operation} {b}? It is {value}.",
        ]))
    sentences.append(rng.choice(["Check each answer by working it out again.",
                                 "With practice, these become quick to do in your head.",
                                 "A calculator gives the same results."]))
    return " ".join(sentences)


def arithmetic_domain(out: Path, heldout: str) -> str:
    """WIST's arithmetic domain, written once to ``OUT/data/arithmetic/``: the tree (Arithmetic → three
    operations → three leaves each, as many children as ``max_children``, so the tree is the given
    curriculum and no unk is drawn), its titles, ``PAGES_PER_LEAF`` pages per leaf as a local corpus
    (``pages.jsonl``) and the challenger's prompt. No page holds a held-out sum, in either order."""
    from sptool.stages.tree.document import add_node, new_tree, save_tree

    target = out / "data" / "arithmetic"
    if (target / "pages.jsonl").is_file():
        return str(target)
    import random

    held = set()
    for record in read_jsonl(Path(heldout)):
        match = SUM.match(record.get("question", ""))
        if match:
            a, b = int(match.group(1)), int(match.group(2))
            held |= {("+", a, b), ("+", b, a)}
    tree = new_tree("Arithmetic", max_depth=3, max_children=ARITHMETIC_MAX_CHILDREN, children=list(ARITHMETIC_LEAVES))
    domain_id = tree["nodes"][tree["root"]]["children"][0]
    rng = random.Random(0)
    pages, titles = [], ["Arithmetic", *ARITHMETIC_LEAVES]
    for label, leaves in ARITHMETIC_LEAVES.items():
        operation_id = add_node(tree, domain_id, label)  # the node new_tree made: its id
        for leaf, (operation, a_digits, b_digits) in leaves.items():
            add_node(tree, operation_id, leaf, evidence={"source": "init"})
            titles.append(leaf)
            for number in range(1, PAGES_PER_LEAF + 1):
                pages.append({"title": leaf, "url": f"https://arithmetic.example/{leaf.lower().replace(' ', '-')}/{number}",
                              "text": arithmetic_page(leaf, operation, (a_digits, b_digits), rng, held)})
    target.mkdir(parents=True, exist_ok=True)
    save_tree(tree, target / "tree.json")
    (target / "titles.txt").write_text("".join(t + "\n" for t in titles), encoding="utf-8")
    (target / "challenger.txt").write_text(ARITHMETIC_CHALLENGER, encoding="utf-8")
    (target / "pages.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pages), encoding="utf-8")
    return str(target)


#: GPU memory an arm may take (float32 runs 4-8: about 20 GB each at --gen-batch 256, 20-41 GB at 1024;
#: four of them ran out of memory on an 80 GB H100, five on a 140 GB H200)
GIB_PER_ARM = 24


def default_parallel(device: str, total_gib: float | None = None) -> int:
    """Arms at once: one per :data:`GIB_PER_ARM` of the GPU's memory, 1 to 4 (an H100's 79 GiB:
    3; an H200's 140 GiB: 4); 1 on a CPU."""
    if not device.startswith("cuda"):
        return 1
    if total_gib is None:
        import torch

        total_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / 1024 ** 3
    return max(1, min(4, int(total_gib // GIB_PER_ARM)))


def sptool_run(recipe: str, run_dir: Path, iterations: int, sets: dict, seed: int, label: str) -> None:
    """``sptool run`` in a subprocess, its iteration lines shown with ``label``; raises on failure."""
    command = [sys.executable, "-m", "sptool.cli.main", "run", "--recipe", recipe, "--run-dir", str(run_dir),
               "-n", str(iterations), "--seed", str(seed)]
    if (run_dir / "manifest.json").is_file():
        command.append("--resume")
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(value) if isinstance(value, (str, bool, list)) else value}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{run_dir.name}.command.txt").write_text(" ".join(command) + "\n", encoding="utf-8")
    tail: list[str] = []
    with subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                          cwd=ROOT) as process:
        for line in process.stderr:
            tail = (tail + [line.rstrip()])[-30:]
            if re.search(r"(iteration \d+/|held-out|error)", line):
                print(f"[{label}] {line.rstrip()}", file=sys.stderr, flush=True)
    if process.returncode != 0:
        raise RuntimeError(f"{label}: sptool run failed (exit {process.returncode}):\n" + "\n".join(tail))


# ---------------------------------------------------------------------------- reading a run

def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sum_truth(question: str) -> int | None:
    """The answer of ``What is A + B?``, or None for any other question."""
    match = SUM.match(question or "")
    return int(match.group(1)) + int(match.group(2)) if match else None


ARITHMETIC = re.compile(r"^\s*What is ([-+*/^().\d\s]+)\?\s*$")


def arithmetic_truth(question: str) -> float | None:
    """The value of ``What is EXPR?`` when EXPR is closed arithmetic on numbers (+ − × / ^, brackets;
    ``^`` as a power with an exponent of at most 10): the question is well posed, it has one answer,
    which is what R-Quest's valid-question rate asks of a proposal (the paper's judge reads each
    question for a flaw). None for anything else: a variable, a blank, a division by zero, words."""
    import ast
    import operator

    match = ARITHMETIC.match(question or "")
    if not match or not re.search(r"\d", match.group(1)):
        return None
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 10:
                raise ValueError("exponent too large")
            return ops[type(node.op)](left, right)
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(match.group(1).replace("^", "**"), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    return float(result) if isinstance(result, (int, float)) and math.isfinite(result) else None


def label_is_right(question: str, label, truth=sum_truth) -> bool | None:
    """Whether ``label`` (its part after the last "=") is ``truth(question)``; None where the question
    has no such truth (by default: not a sum)."""
    truth = truth(question)
    if truth is None:
        return None
    value = re.sub(r"[\s$,]|\\!|\\,", "", str(label).rsplit("=", 1)[-1]).rstrip(".")  # "47 + 38 = 85": 85
    try:
        return float(value) == truth
    except ValueError:
        return False


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def step_files(run_dir: Path, iteration: int, suffix: str) -> list[Path]:
    """The outputs of an iteration's steps whose name ends with ``suffix`` (``NN-s-pool.jsonl``)."""
    folder = run_dir / f"iter-{iteration:04d}"
    return sorted(p for p in folder.glob(f"*-{suffix}.jsonl") if not p.name.endswith(".rejects.jsonl"))


def round_stats(run_dir: Path, iteration: int) -> dict:
    """One round's pool and questioner figures, read from its step outputs."""
    stats: dict = {}
    pool = [r for p in step_files(run_dir, iteration, "s-pool") for r in read_jsonl(p)]
    if pool or step_files(run_dir, iteration, "s-pool"):
        verdicts = [label_is_right(r["question"], r["answer"]) for r in pool]
        known = [v for v in verdicts if v is not None]
        stats["pool"] = len(pool)
        stats["pseudo_label_accuracy"] = share(sum(known), len(known))
        stats["label_source"] = pool[0].get("label_source") if pool else None
    proposals, well_formed, sums, well_posed = 0, 0, 0, 0
    for path in step_files(run_dir, iteration, "challenge"):
        proposals += len(read_jsonl(path))
        rejects = path.with_name(path.name.replace(".jsonl", ".rejects.jsonl"))
        proposals += len(read_jsonl(rejects))
        for record in read_jsonl(path):
            if record.get("valid", True) and record.get("question"):
                well_formed += 1
                sums += sum_truth(record["question"]) is not None
                well_posed += arithmetic_truth(record["question"]) is not None
    if proposals:
        stats.update(proposals=proposals, well_formed_rate=share(well_formed, proposals),
                     valid_rate=share(sums, proposals), well_posed_rate=share(well_posed, proposals))
    gate_in = sum(len(read_jsonl(p)) for p in step_files(run_dir, iteration, "verify-validity"))
    if gate_in:
        from sptool.recipes.rzero import passes_the_validity_gate

        passed = sum(passes_the_validity_gate(r) for p in step_files(run_dir, iteration, "verify-validity")
                     for r in read_jsonl(p))
        stats["validity_gate_rate"] = share(passed, gate_in)
    judged = [r for p in step_files(run_dir, iteration, "novelty") for r in read_jsonl(p)
              if isinstance(r.get("novelty"), dict)]  # malformed questions pass through unjudged
    if judged:
        # the stage writes {"novel": bool, "compared": [...], "judge": ..., "k": ...}
        stats["novel_rate"] = share(sum(bool(r["novelty"].get("novel")) for r in judged), len(judged))
    leaves = leaf_stats([r for p in step_files(run_dir, iteration, "verify") for r in read_jsonl(p)])
    if leaves:
        stats["leaves"] = leaves
    return stats


def leaf_stats(verified: list[dict]) -> dict:
    """WIST, per leaf of a round's graded questions: how many, the solver's mean agreement p̂ with
    the challenger's answer, and how many were learnable: g = 1(p̂(1 − p̂) ≥ τ_var) for a valid
    question (WIST Eq. 15 at the recipe's default τ_var, which no arm changes), the observation that
    moves the leaf's posterior. For the arithmetic domain, also the questions of one operation on two
    numbers (``closed``) and how many of those the challenger labelled right (``label_right``): p̂ is
    agreement with that label, so a wrong label keeps g at 0 whatever the solver can do."""
    from sptool.stages.tree import learnability_observation

    leaves: dict = {}
    for record in verified:
        if record.get("leaf") is None or record.get("p_hat") is None:
            continue
        entry = leaves.setdefault(record["leaf"], {"questions": 0, "p_hat_sum": 0.0, "learnable": 0,
                                                   "closed": 0, "label_right": 0})
        entry["questions"] += 1
        entry["p_hat_sum"] += float(record["p_hat"])
        entry["learnable"] += record.get("valid") is not False and learnability_observation(float(record.get("var") or 0))
        right = label_is_right(record.get("question") or "", record.get("answer"), truth=one_operation_value)
        if right is not None:
            entry["closed"] += 1
            entry["label_right"] += right
    return {leaf: {"questions": e["questions"], "mean_p_hat": e["p_hat_sum"] / e["questions"],
                   "learnable": e["learnable"], "closed": e["closed"], "label_right": e["label_right"]}
            for leaf, e in sorted(leaves.items())}


ONE_OPERATION = re.compile(r"What is (\d+) ?([-+*×x]) ?(\d+) ?=? ?\?")


def one_operation_value(question: str) -> int | None:
    """The value of ``What is A op B?`` (op one of + − × on whole numbers), else None: the
    arithmetic domain's questions whose right answer the report can check."""
    match = ONE_OPERATION.fullmatch(" ".join(question.split()))
    if not match:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def count_or_none(total: int | None, more: int | None) -> int | None:
    """A count summed over rounds, unknown (None) once a round did not record it."""
    return None if total is None or more is None else total + more


def metric_leaves(lines: list[dict]) -> dict[int, dict]:
    """WIST, per round, :func:`leaf_stats` from the posterior update's metrics line, whose tree rows
    carry each drawn leaf's ``questions`` and ``mean_p_hat`` (``sptool.recipes.wist.round_leaves``)."""
    out: dict[int, dict] = {}
    for line in lines:
        if line.get("kind") != "posterior-update" or not line.get("tree"):
            continue
        leaves: dict = {}
        for node in line["tree"]:
            if node.get("questions"):
                entry = leaves.setdefault(node["label"], {"questions": 0, "p_hat_sum": 0.0, "learnable": 0})
                entry["questions"] += node["questions"]
                entry["p_hat_sum"] += node["questions"] * node["mean_p_hat"]
                entry["learnable"] = count_or_none(entry["learnable"], node.get("learnable"))  # none before 2026-12-05
        if leaves:
            out[line["iteration"]] = {leaf: {"questions": e["questions"], "mean_p_hat": e["p_hat_sum"] / e["questions"],
                                             "learnable": e["learnable"]} for leaf, e in sorted(leaves.items())}
    return out


def posterior_means(lines: list[dict]) -> dict:
    """WIST: the tree's nodes after each round's posterior update, ``{iteration: {label: mean}}``
    (the nodes at the deepest level of that tree: the leaves paths end at)."""
    out = {}
    for line in lines:
        if line.get("kind") == "posterior-update" and line.get("tree"):
            deepest = max(node["depth"] for node in line["tree"])
            out[str(line["iteration"])] = {node["label"]: node["mean"] for node in line["tree"]
                                           if node["depth"] == deepest}
    return out


def run_summary(run_dir: Path, heldout_name: str) -> dict:
    """Held-out figures per evaluation, per-round stats, the solver updates' entropy and reward."""
    lines = read_jsonl(run_dir / "metrics.jsonl")
    evals = []
    for line in lines:
        if line.get("kind") == "eval":
            figures = (line.get("benchmarks") or {}).get(heldout_name) or next(iter((line.get("benchmarks") or
                                                                                     {None: {}}).values()))
            evals.append({"after_iteration": line.get("after_iteration"), **(figures or {})})
    updates = [{"iteration": line.get("iteration"), "stage": line.get("stage"), **solver}
               for line in lines if line.get("kind") == "train" and solver_update(line)
               for solver in [(line.get("roles") or {}).get("solver") or (line.get("roles") or {}).get("policy")]
               if solver]
    iterations = sorted({line["iteration"] for line in lines if isinstance(line.get("iteration"), int)
                         and line["iteration"] > 0})
    rounds = {str(i): round_stats(run_dir, i) for i in iterations}
    for i, leaves in metric_leaves(lines).items():  # WIST: when the round's verify file was not kept
        if str(i) in rounds and not rounds[str(i)].get("leaves"):
            rounds[str(i)]["leaves"] = leaves
    return {"evals": evals, "rounds": rounds,
            "posterior": posterior_means(lines),
            "updates": [{k: v for k, v in u.items() if k in ("iteration", "stage", "step", "entropy", "loss",
                                                              "ratio_mean", "ratio_max", "clip_fraction",
                                                              "logprob_gap", "groups", "groups_with_signal")}
                        for u in updates]}


def solver_update(line: dict) -> bool:
    stage = str(line.get("stage", ""))
    return not stage.startswith("q") and not stage.startswith("init")


# ---------------------------------------------------------------------------- one arm

def checkpoint_of(run_dir: Path) -> str | None:
    """The newest solver (or policy) checkpoint of a run; None when the solver was never updated."""
    found = [p for role in ("solver", "policy") for p in (run_dir / "ckpt" / role).glob("step-*")]
    return str(max(found, key=lambda p: int(p.name.split("-")[1]))) if found else None


def harness_accuracy(s: Settings, checkpoint: str) -> float:
    """Greedy accuracy of a checkpoint by learning_parity's function (the cross-check)."""
    import torch
    from transformers import AutoModelForCausalLM

    import learning_parity as lp

    settings = lp.Settings(device=s.device, steps=0, problems=s.problems, samples=s.samples,
                           max_tokens=s.max_tokens, lr=s.lr, seed=0, eval_every=0, micro_batch=1,
                           model=s.model, heldout=s.heldout, heldout_limit=s.heldout_limit, prompt=s.prompt)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(lp.model_path(s.model))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(s.device)
    template = Path(s.prompt).read_text(encoding="utf-8")
    return lp.greedy_accuracy(model, tokenizer, lp.read_jsonl(s.heldout, s.heldout_limit), template, settings)


#: flawed forms of ``What is A + B?`` for R-Quest's validity initialisation: no single answer
# flaws of the kinds the questioner writes (run 5: "What is 2 + ?", "What is 32 + 42 (10x-32)?"); the
# last two joined runs 1-6's four after the solver's gate passed every proposal of run 5
FLAWED_SUMS = ("What is {a} + ?", "What is x + {b}?", "What is {a} + the other number?", "What is {a} + {b} + ?",
               "What is {a} + {b} ({b}x - {a})?", "What is {a} + {b}y?")


def validity_init_set(out: Path) -> str:
    """R-Quest's validity-initialisation set at this scale, written once to ``OUT/data/``: 48 valid
    one-digit sums and 16 flawed ones (answer INVALID).

    The packaged set (12 word problems, half of them flawed) taught the 0.26 start to answer
    INVALID to everything (H200 run 3). It could solve none of the word problems. Under R_init, a
    right INVALID pays +1, rejecting a valid problem −0.5 and a wrong answer 0. So INVALID paid 0.25
    a problem, and answering paid 0. After that, the start rejected 72–91% of the questioner's plain
    sums. With sums it can solve and one flawed problem in four, always answering INVALID pays −0.125.
    The sums have one digit so that no label of the held-out kind (two digits) reaches the arm: the
    set is trained first and replayed in every solver update (``replay_share``)."""
    target = out / "data" / "validity_init_sums.jsonl"
    if target.is_file():
        return str(target)
    import random

    pairs = random.Random(0).sample([(a, b) for a in range(1, 10) for b in range(1, 10)], 81)
    valid = [{"id": f"vi-sum-{i}", "question": f"What is {a} + {b}?", "answer": str(a + b), "flaw": None}
             for i, (a, b) in enumerate(pairs[:48])]
    questions: list[str] = []
    for a, b in pairs[48:]:
        question = FLAWED_SUMS[len(questions) % len(FLAWED_SUMS)].format(a=a, b=b)
        if question not in questions and len(questions) < 16:
            questions.append(question)
    flawed = [{"id": f"vi-flawed-{i}", "question": question, "answer": "INVALID",
               "flaw": "an operand is missing or unknown"} for i, question in enumerate(questions)]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")  # workers may write it at once
    partial.write_text("".join(json.dumps(r) + "\n" for r in valid + flawed), encoding="utf-8")
    partial.replace(target)
    return str(target)


def heldout_subset(s: Settings, out: Path) -> str:
    """The held-out file every evaluation reads: the set itself, or its first ``heldout_limit``
    problems in ``OUT/heldout/`` under the same name (``run --eval`` reads a whole file)."""
    if not s.heldout_limit:
        return s.heldout
    subset = out / "heldout" / Path(s.heldout).name
    if subset.is_file():
        return str(subset)
    subset.parent.mkdir(parents=True, exist_ok=True)
    subset.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(Path(s.heldout))[:s.heldout_limit]),
                      encoding="utf-8")
    return str(subset)


def make_start(s: Settings, out: Path) -> str:
    """rlvr from the base model for ``start_steps`` steps; its checkpoint is every arm's start."""
    run_dir = out / "start" / "run"
    done = out / "start" / "start.json"
    if done.is_file():
        return json.loads(done.read_text())["checkpoint"]
    sets = {**common_sets(s), "model.policy": s.model, "rlvr.data": s.train, "rlvr.problems": s.problems,
            "rlvr.samples": s.samples, "rlvr.format_weight": 0.1, "rlvr.keep_equal_groups": True,
            "eval.every": 0}
    began = time.time()
    sptool_run("rlvr", run_dir, s.start_steps, sets, 0, "start")
    checkpoint = checkpoint_of(run_dir)
    if checkpoint is None:
        raise RuntimeError(f"{run_dir}: the start run wrote no checkpoint")
    summary = run_summary(run_dir, Path(s.heldout).stem)
    done.write_text(json.dumps({"checkpoint": checkpoint, "wall_s": time.time() - began, **summary}, indent=1) + "\n")
    return checkpoint


def run_arm(arm: str, seed: int, s: Settings, start: str, out: Path) -> dict:
    label = f"{arm}-s{seed}"
    began = time.time()
    result: dict = {"arm": arm, "seed": seed, "settings": asdict(s), "start": start}
    if arm == "start":
        result["evals"] = [{"after_iteration": 0, "greedy": harness_accuracy(s, start)}]
        result["rounds"], result["updates"] = {}, []
    else:
        recipe, iterations, sets = arm_plan(arm, s, start)
        run_dir = out / "runs" / label
        sptool_run(recipe, run_dir, iterations, sets, seed, label)
        result.update(recipe=recipe, iterations=iterations, sets=sets, **run_summary(run_dir, Path(s.heldout).stem))
        last = checkpoint_of(run_dir)  # None: no update had a learning signal, the solver is the start
        result["harness_final_greedy"] = harness_accuracy(s, last or start)
    result["wall_s"] = time.time() - began
    (out / f"{label}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"[{label}] done in {result['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return result


# ---------------------------------------------------------------------------- the report

def partial_results(out: Path, finished: set[str]) -> list[dict]:
    """Arms whose run stopped before the end (a killed job, out of memory, a time limit): what their
    run directories hold, marked ``partial``, so a cut-short run still reports its finished rounds."""
    found = []
    for command in sorted((out / "runs").glob("*-s*.command.txt")):
        label = command.name[:-len(".command.txt")]
        arm, _, seed = label.rpartition("-s")
        run_dir = out / "runs" / label
        if label in finished or arm not in ARMS or not seed.isdigit() or not (run_dir / "metrics.jsonl").is_file():
            continue
        config = (run_dir / "config.toml").read_text(encoding="utf-8") if (run_dir / "config.toml").is_file() else ""
        recipe = re.search(r'^recipe = "(\w+)"', config, re.MULTILINE)
        settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else {}
        found.append({"arm": arm, "seed": int(seed), "partial": True, "settings": settings,
                      "recipe": recipe.group(1) if recipe else None,
                      **run_summary(run_dir, Path(settings.get("heldout", "addition_heldout_300")).stem)})
    return found


def leaf_totals(result: dict) -> dict:
    """WIST, per leaf over the arm's rounds: ``{leaf: {questions, first, last, learnable, closed,
    label_right}}`` (the mean p̂ of the first and the last round that drew the leaf; the counts of
    :func:`leaf_stats`, None where a round did not record them)."""
    totals: dict = {}
    for _, stats in sorted(result.get("rounds", {}).items(), key=lambda kv: int(kv[0])):
        for leaf, figures in (stats or {}).get("leaves", {}).items():
            entry = totals.setdefault(leaf, {"questions": 0, "first": figures["mean_p_hat"], "last": None,
                                             "learnable": 0, "closed": 0, "label_right": 0})
            entry["questions"] += figures["questions"]
            entry["last"] = figures["mean_p_hat"]
            for key in ("learnable", "closed", "label_right"):  # None where a round's verify file was not kept
                entry[key] = count_or_none(entry[key], figures.get(key))
    return totals


def later_share(result: dict, leaves: set, within: set | None = None) -> float | None:
    """The share of an arm's graded questions, in the later half of its rounds, written from ``leaves``
    (counting only the questions from ``within`` when given: the leaves both compared arms drew)."""
    rounds = sorted(result.get("rounds", {}), key=int)
    later = rounds[len(rounds) // 2:]
    counts = [(leaf in leaves, f["questions"]) for i in later
              for leaf, f in (result["rounds"][i] or {}).get("leaves", {}).items() if within is None or leaf in within]
    return share(sum(n for inside, n in counts if inside), sum(n for _, n in counts))


def standard_error(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def updates_per_eval(result: dict) -> int:
    """Solver updates between two of the arm's evaluations (rounds × solver_steps for every arm)."""
    return result["settings"]["solver_steps"]


def curve(result: dict) -> dict[int, dict]:
    """Held-out figures by solver updates done (round r of R-Zero = r × solver_steps updates)."""
    per = 1 if result.get("recipe") in ("rlvr", "svs") else updates_per_eval(result)
    return {int(e["after_iteration"]) * per: e for e in result.get("evals", []) if e.get("after_iteration") is not None}


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(out: Path) -> str:
    """The tables of every ``<arm>-s<seed>.json`` in ``out``; writes ``selfplay.json`` and ``.md``."""
    results = [json.loads(p.read_text()) for p in out.glob("*-s*.json")]
    results += partial_results(out, {f"{r['arm']}-s{r['seed']}" for r in results})
    results.sort(key=lambda r: (ARMS.index(r["arm"]) if r["arm"] in ARMS else 99, r["seed"]))
    if not results:
        raise SystemExit(f"{out}: no arm results (<arm>-s<seed>.json)")
    s = next(r["settings"] for r in results if r.get("settings"))
    start_file = out / "start" / "start.json"
    start_info = json.loads(start_file.read_text()) if start_file.is_file() else {}
    n = s["heldout_limit"] or len(read_jsonl(Path(s["heldout"]))) or len(
        read_jsonl(ROOT / "fixtures" / "bench" / Path(s["heldout"]).name))  # results moved from another machine
    start_acc = next((r["evals"][0]["greedy"] for r in results if r["arm"] == "start"), None)
    if start_acc is None:
        start_acc = next((c[0]["greedy"] for c in map(curve, results) if 0 in c), None)
    steps = sorted({k for r in results for k in curve(r)})
    lines = [f"# Self-play in miniature ({s['device']})", "",
             f"Start: rlvr for {s['start_steps']} steps from {s['model']}; held-out greedy {fmt(start_acc)} "
             f"on {n} problems (s.e. {fmt(standard_error(start_acc or 0, n))}). Each arm: {s['rounds']} rounds "
             f"of {s['solver_steps']} solver updates of {s['problems']} questions x {s['samples']} rollouts, "
             f"{s['max_tokens']} new tokens, lr {s['lr']}; the label-free arms' solver band "
             f"{s.get('band') or ([0.3, 0.8] if s['device'].startswith('cuda') else [0.0, 1.0])}; "
             f"format credit {s.get('format_weight', 0.1)} in every arm.", "",
             "## Held-out greedy accuracy by solver updates", "",
             "| arm | seed | " + " | ".join(str(k) for k in steps) + " | final − start (s.e.) | harness |",
             "|---|---|" + "---|" * len(steps) + "---|---|"]
    verdicts: dict = {}
    for r in results:
        c = curve(r)
        final = c[max(c)]["greedy"] if c else None
        gain = None if final is None or start_acc is None else final - start_acc
        se = math.sqrt(standard_error(start_acc or 0, n) ** 2 + standard_error(final or 0, n) ** 2) if c else None
        r["gain"], r["gain_se"] = gain, se
        lines.append(f"| {r['arm']}{' (cut short)' if r.get('partial') else ''} | {r['seed']} | "
                     + " | ".join(fmt(c[k]["greedy"]) if k in c else "-" for k in steps)
                     + f" | {fmt(gain)} ({fmt(se)}) | {fmt(r.get('harness_final_greedy'))} |")
    answered_rows = [r for r in results if any(v.get("answered") is not None for v in curve(r).values())]
    if answered_rows:
        lines += ["", "## Held-out: the share of greedy answers the grader could read", "",
                  "A gain that this share explains is format (a readable \\boxed{} answer), not arithmetic; "
                  "accuracy among the readable answers is in brackets.", "",
                  "| arm | seed | " + " | ".join(str(k) for k in steps) + " |", "|---|---|" + "---|" * len(steps)]
        for r in answered_rows:
            c = curve(r)
            lines.append(f"| {r['arm']} | {r['seed']} | " + " | ".join(
                f"{fmt(c[k].get('answered'))} ({fmt(c[k]['greedy'] / c[k]['answered'] if c[k].get('answered') else None)})"
                if k in c else "-" for k in steps) + " |")
    pass_rows = [(r, {k: v for k, v in curve(r).items() if any(x.startswith("pass@") and x != "pass@1" for x in v)})
                 for r in results]
    pass_rows = [(r, c) for r, c in pass_rows if c]
    if pass_rows:
        lines += ["", "## pass@k and mean@k (sampled, temperature 1) and the solver updates' entropy", "",
                  "| arm | seed | updates | greedy | mean@k | pass@k | mean entropy of updates |", "|---|---|---|---|---|---|---|"]
        for r, c in pass_rows:
            entropy = [u["entropy"] for u in r.get("updates", []) if u.get("entropy") is not None]
            for k, v in sorted(c.items()):
                key = next(x for x in v if x.startswith("pass@") and x != "pass@1")
                lines.append(f"| {r['arm']} | {r['seed']} | {k} | {fmt(v.get('greedy'))} | {fmt(v.get('mean@k'))} | "
                             f"{key} {fmt(v[key])} | {fmt(sum(entropy) / len(entropy) if entropy else None)} |")
    round_rows = [r for r in results if r.get("rounds") and r["arm"] in LABEL_FREE]
    if round_rows:
        lines += ["", "## Per round: the solver's pool and the questioner", "",
                  "| arm | seed | round | pool | pseudo-label accuracy | well-formed | valid (A + B) | well-posed "
                  "arithmetic | validity gate | novel |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in round_rows:
            for i, st in sorted(((i, st) for i, st in r["rounds"].items() if st), key=lambda kv: int(kv[0])):
                lines.append(f"| {r['arm']} | {r['seed']} | {i} | {st.get('pool', '-')} | "
                             f"{fmt(st.get('pseudo_label_accuracy'))} | {fmt(st.get('well_formed_rate'))} | "
                             f"{fmt(st.get('valid_rate'))} | {fmt(st.get('well_posed_rate'))} | "
                             f"{fmt(st.get('validity_gate_rate'))} | "
                             f"{fmt(st.get('novel_rate'))} |")
    wist_rows = [r for r in results if r["arm"] in ("wist", "wist-uniform") and r.get("rounds")]
    if wist_rows:
        lines += ["", "## WIST: where the paths go", "",
                  "Per leaf, over every round: the graded questions written from its pages (their share), the "
                  "share of them with g = 1 (p̂(1 − p̂) ≥ τ_var: what moves the leaf's posterior), the "
                  "solver's mean agreement p̂ with the challenger in the first and the last round that drew the "
                  "leaf, and the leaf's posterior mean after the last round. Label right: of the questions of one "
                  "operation on two numbers, those whose challenger answer is the true value (p̂ is agreement "
                  "with that answer).", "",
                  "| arm | seed | leaf | questions (share) | g = 1 | p̂ first → last | posterior mean | label right |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in wist_rows:
            totals = leaf_totals(r)
            everything = sum(t["questions"] for t in totals.values()) or 1
            posterior = r.get("posterior") or {}
            last_posterior = posterior[max(posterior, key=int)] if posterior else {}
            for leaf, t in sorted(totals.items(), key=lambda kv: -kv[1]["questions"]):
                learnable = share(t["learnable"], t["questions"]) if t["learnable"] is not None else None
                labels = "-" if t["closed"] is None else f"{t['label_right']} of {t['closed']}"
                lines.append(f"| {r['arm']} | {r['seed']} | {leaf} | {t['questions']} ({t['questions'] / everything:.2f}) | "
                             f"{fmt(learnable, 2)} | {fmt(t['first'])} → {fmt(t['last'])} | {fmt(last_posterior.get(leaf))} | "
                             f"{labels} |")
    # the issue's targets
    lines += ["", "## Targets", ""]
    for arm in ("rzero", "rquest", "shuffled"):
        mine = [r for r in results if r["arm"] == arm and r.get("gain") is not None]
        if mine:
            met = [r["gain"] >= 0.10 and r["gain"] > 3 * r["gain_se"] for r in mine]
            verdicts[arm] = {"seeds": [r["seed"] for r in mine], "gains": [r["gain"] for r in mine],
                             "se": [r["gain_se"] for r in mine], "gain_at_least_0.10_beyond_3se": met}
            lines.append(f"- {arm}: final − start " + ", ".join(f"{r['gain']:+.3f} (3 s.e. {3 * r['gain_se']:.3f}, "
                                                                 f"seed {r['seed']})" for r in mine)
                         + f": {'met' if all(met) and len(met) >= 2 else 'not met'} (+0.10 beyond 3 s.e. in 2 seeds)")
    if "shuffled" in verdicts:
        # the issue's bar: a label-free gain that the random-label control (same questions, wrong
        # labels) does not also show; otherwise the gain is not from the pseudo-labels
        control_met = verdicts["shuffled"]["gain_at_least_0.10_beyond_3se"]
        control_gains = any(control_met)
        for arm in ("rzero", "rquest"):
            if arm in verdicts:
                own = all(verdicts[arm]["gain_at_least_0.10_beyond_3se"]) and len(verdicts[arm]["seeds"]) >= 2
                verdicts[arm]["beyond_control"] = own and not control_gains
                control = (f"also does in {sum(control_met)} of {len(control_met)} seeds, so the gain is not shown "
                           "to come from the pseudo-labels") if control_gains else "does not"
                lines.append(f"- {arm} against the random-label control: {'met' if own and not control_gains else 'not met'} "
                             f"({arm} {'gains' if own else 'does not gain'} +0.10 beyond 3 s.e. in 2 seeds; the control "
                             f"{control})")
    rz = {r["seed"]: r for r in results if r["arm"] == "rzero"}
    rq = {r["seed"]: r for r in results if r["arm"] == "rquest"}
    for seed in sorted(set(rz) & set(rq)):
        for key, name in (("valid_rate", "valid (A + B) rate"), ("well_posed_rate", "well-posed rate")):
            pairs = [(i, rq[seed]["rounds"][i].get(key), rz[seed]["rounds"].get(i, {}).get(key))
                     for i in rq[seed]["rounds"]]
            ok = all(a is not None and b is not None and a >= b for _, a, b in pairs)
            lines.append(f"- {name}, R-Quest ≥ R-Zero in every round (seed {seed}): {'met' if ok else 'not met'} "
                         + ", ".join(f"round {i}: {fmt(a)} vs {fmt(b)}" for i, a, b in pairs))
    for seed in sorted({r["seed"] for r in wist_rows}):
        pair = {r["arm"]: r for r in wist_rows if r["seed"] == seed}
        if set(pair) != {"wist", "wist-uniform"}:
            continue
        totals = {arm: leaf_totals(pair[arm]) for arm in pair}
        missing = [arm for arm in pair if not totals[arm]]
        if missing:  # e.g. a cut-short arm whose verify files were not kept, from a run before the metrics had them
            verdicts[f"wist_seed_{seed}"] = {"met": None, "why": f"no per-leaf data for {', '.join(missing)}"}
            lines.append(f"- WIST's later paths go to the leaves where the solver improved (seed {seed}): not "
                         f"measurable, no per-leaf data for {', '.join(missing)}")
            continue
        # the leaves both arms drew (each arm grows its own tree), and among them those where the solver
        # improved as the uniform arm (which draws every leaf alike) saw them
        common = set(totals["wist"]) & set(totals["wist-uniform"])
        improving = {leaf for leaf, t in totals["wist-uniform"].items() if leaf in common
                     and t["first"] is not None and t["last"] is not None and t["last"] > t["first"]}
        if not improving:  # the shares are then 0 in both arms, and a verdict would follow by construction
            verdicts[f"wist_seed_{seed}"] = {"improving_leaves": [], "common_leaves": len(common), "met": None,
                                             "why": "the solver improved on no leaf both arms drew"}
            lines.append(f"- WIST's later paths go to the leaves where the solver improved (seed {seed}): not "
                         f"measurable, the uniform arm's p̂ rose on none of the {len(common)} leaves both arms drew")
            continue
        shares = {arm: later_share(pair[arm], improving, within=common) for arm in pair}
        ok = shares["wist"] is not None and shares["wist-uniform"] is not None and shares["wist"] > shares["wist-uniform"]
        verdicts[f"wist_seed_{seed}"] = {"improving_leaves": sorted(improving), "common_leaves": len(common),
                                         "later_share": shares, "met": ok}
        lines.append(f"- WIST's later paths go to the leaves where the solver improved (seed {seed}; "
                     f"{', '.join(sorted(improving)) or 'none'}, of the {len(common)} leaves both arms drew): share "
                     f"of its questions on those {len(common)} leaves that went there in the later half of the rounds "
                     f"{fmt(shares['wist'])} against the uniform arm's {fmt(shares['wist-uniform'])}: "
                     f"{'met' if ok else 'not met'}")
    text = "\n".join(lines) + "\n"
    summary = {"settings": s, "start": {"greedy": start_acc, **{k: v for k, v in start_info.items() if k != "updates"}},
               "heldout_problems": n, "arms": results, "targets": verdicts}
    (out / "selfplay.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "selfplay.md").write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(ARMS)} "
                        "(default: all on cuda, rzero,shuffled on cpu)")
    parser.add_argument("--seeds", default=None, help="comma-separated run seeds (default 1,2 on cuda, 1 on cpu)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    for name, kind in (("rounds", int), ("start-steps", int), ("solver-steps", int), ("problems", int),
                       ("samples", int), ("questions", int), ("pool", int), ("max-tokens", int),
                       ("heldout-limit", int), ("pass-k", int)):
        parser.add_argument(f"--{name}", type=kind, default=None)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gen-batch", type=int, default=1024, help="sequences per generate call on cuda (lower it "
                        "when many arms share one GPU: each R-Zero arm holds two models and their caches)")
    parser.add_argument("--band", default=None, metavar="LOW,HIGH",
                        help="the p̂ band of the label-free arms' solver pool (default 0.3,0.8, R-Quest §2.1). A higher "
                        "band keeps the questions the vote is surer of: its majority labels are right more often")
    parser.add_argument("--format-weight", type=float, default=0.1,
                        help="every arm's reward for a readable \\boxed{} answer (default 0.1; the start keeps 0.1). "
                        "0: the random-label control gets no reward from format, so a gain it shares is not format")
    parser.add_argument("--decoder", default="generate", choices=("generate", "step"),
                        help="model.decoder of every arm (step: shared-prompt prefill, a sync-free step)")
    parser.add_argument("--decode-attention", default="model", choices=("model", "grouped"),
                        help="model.decode_attention of every arm (grouped: one decoding position against the "
                        "KV cache, read once)")
    parser.add_argument("--mixed-precision", default="auto", choices=("auto", "no", "bf16"),
                        help="train.mixed_precision of every arm and the start (auto: the tool's default, bf16 with "
                        "stochastic weight rounding on CUDA; no: float32, as in runs 1-5)")
    parser.add_argument("--rquest-novelty", default="repeat", choices=("repeat", "template"),
                        help="R-Quest's novelty gate: repeat (only a repeated question is the same: on a task of one "
                        "template the paper's same-type gate finds every sum the same type and pays nothing; the "
                        "default) or template (numbers masked, similarity >= 0.6: runs 1-6)")
    parser.add_argument("--wist-domain", default="arithmetic", choices=("arithmetic", "mathematics"),
                        help="the WIST arms' domain: arithmetic (nine leaves from one-digit sums to two-digit "
                        "products, 10 local pages each, no held-out sum: the solver's agreement with the "
                        "challenger spreads over the learnability band; the default) or mathematics (the "
                        "packaged tree and sample pages, run 4: g was 1 on 2-12%% of questions)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--start", default=None, help="a start checkpoint (skips making one)")
    parser.add_argument("--parallel", type=int, default=None, help="arms at once (default on cuda: one per "
                        f"{GIB_PER_ARM} GiB of the GPU, at most 4; 1 on cpu)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results/selfplay-DEVICE)")
    parser.add_argument("--retries", type=int, default=1, help="runs of a failed arm again, once the others have "
                        "ended, resuming its run (an arm beside others mostly fails for GPU memory; default 1)")
    parser.add_argument("--report", default=None, metavar="DIR", help="only write and print the tables of DIR")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(Path(args.report)), end="")
        return 0
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    given = {k: getattr(args, k) for k in defaults(device) if getattr(args, k) is not None}
    band = None
    if args.band:
        try:
            band = [float(x) for x in args.band.split(",")]
        except ValueError:
            band = []
        if len(band) != 2 or not 0 <= band[0] <= band[1] <= 1:
            raise SystemExit(f"--band: expected LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {args.band!r}")
    if not 0 <= args.format_weight <= 1:
        raise SystemExit(f"--format-weight: expected a number in [0, 1], got {args.format_weight}")
    s = Settings(device=device, lr=args.lr, model=args.model, gen_batch=args.gen_batch, band=band, decoder=args.decoder,
                 decode_attention=args.decode_attention, mixed_precision=args.mixed_precision,
                 format_weight=args.format_weight, rquest_novelty=args.rquest_novelty, wist_domain=args.wist_domain,
                 **{**defaults(device), **given})
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"selfplay-{device.split(':')[0]}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if s.wist_domain == "arithmetic":
        s.wist_data = arithmetic_domain(out, s.heldout)  # the whole held-out set, before any subset
    s.heldout = heldout_subset(s, out)
    s.validity_init = validity_init_set(out)
    if not args.worker:
        (out / "settings.json").write_text(json.dumps(asdict(s), indent=1) + "\n", encoding="utf-8")
    cuda = s.cuda
    if args.worker:  # one arm in this process: "ARM:SEED:START"
        import warnings

        warnings.filterwarnings("ignore")
        arm, seed, start = args.worker.split(":", 2)
        run_arm(arm, int(seed), s, start, out)
        return 0
    arms = [a.strip() for a in (args.arms or (",".join(ARMS) if cuda else "rzero,shuffled")).split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    seeds = [int(x) for x in (args.seeds or ("1,2" if cuda else "1")).split(",")]
    print(f"=== start ({s.start_steps} rlvr steps)", file=sys.stderr, flush=True)
    start = str(Path(args.start).resolve()) if args.start else make_start(s, out)
    print(f"=== start checkpoint: {start}", file=sys.stderr, flush=True)
    jobs = [(arm, seed) for arm in arms for seed in (seeds if arm != "start" else seeds[:1])]
    parallel = args.parallel or default_parallel(device)
    base = list(argv if argv is not None else sys.argv[1:])
    from learning_parity import run_workers

    # each arm in its own process: the same start, nothing shared
    failed = run_workers([(f"{arm}-s{seed}", [sys.executable, __file__, *base, "--device", device, "--out", str(out),
                                              "--worker", f"{arm}:{seed}:{start}"]) for arm, seed in jobs], parallel,
                         retries=args.retries)
    print(report(out), end="")
    if failed:
        print(f"failed arms: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
