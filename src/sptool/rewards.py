"""Every reward and gate formula of the four recipes, as pure functions, in one place.

Each function cites the equation it implements. Sources (the papers' sections):

- WIST: web-grounded iterative self-play tree (§2.2 Eq. 3, §3.4 Eqs. 12–14, role balancing)
- SvS: self-play with variational problem synthesis, Liang et al., 2025 (§3.3 Eqs. 4–6, Algorithm 1)
- R-Quest: R-Zero plus validity and novelty gates (validity initialisation, validity gate, novelty gate,
  questioner reward, solver data, replay)
- R-Zero (Huang et al., 2025, arXiv 2508.05004) as summarised in the WIST and
  R-Quest papers; where R-Zero's reference code differs, the alternative is a keyword option.

Nothing here reads records or files: inputs are numbers, booleans and strings, so every formula
can be tested against values computed by hand.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

# ------------------------------------------------------------------ shared constants (paper defaults)

WIST_SIGMA = 0.02            # WIST Table "Challenger shaping width σ"
WIST_INVALID_PENALTY = -0.1  # WIST Table "Rule-validation penalty ρ"
FORMAT_FAILURE_REWARD = -1.0  # R-Zero / R-Quest: an unparsable questioner output
RZERO_SOLVER_BAND = (0.3, 0.8)   # R-Zero / R-Quest solver data: 0.3 ≤ p ≤ 0.8
SVS_UNDERPERFORMING_BAND = (0.125, 0.5)   # SvS §4 [acc_l, acc_h]
SVS_SYNTHESIS_BAND = (0.125, 0.625)       # SvS §4 [âcc_l, âcc_h]
BLEU_DISTANCE_THRESHOLD = 0.5
PSEUDO_LABEL_FORMAT_WEIGHT = 0.1  # R-Zero / R-Quest solver reward 0.9·correct + 0.1·format
GRPO_EPSILON = 1e-6


# ------------------------------------------------------------------ WIST

def binary_correctness_reward(correct: bool | None) -> float:
    """Solver reward of WIST Eq. 13 (and SvS Eq. 4): r^sol_{i,k} = ℓ_{i,k} = v(ŷ_{i,k}, y*_i) ∈ {0, 1}.

    ``None`` (not gradable) counts as incorrect.
    """
    return 1.0 if correct else 0.0


def empirical_accuracy(correct: Sequence[bool | None]) -> float:
    """WIST Eq. 12: p̂_i = (1/K) Σ_k ℓ_{i,k} (0 for no samples)."""
    return sum(1 for c in correct if c) / len(correct) if correct else 0.0


def empirical_variance(p_hat: float) -> float:
    """WIST Eq. 12: Var̂_i = p̂_i (1 − p̂_i)."""
    return p_hat * (1.0 - p_hat)


def gaussian_variance_reward(var: float, sigma: float = WIST_SIGMA) -> float:
    """Challenger reward of a valid QA, WIST Eq. 14: r^cha_i = exp(−(Var̂_i − 0.25)² / σ).

    σ divides the squared distance directly (not 2σ²), as written in Eq. 14; σ = 0.02 (WIST
    Appendix D). Peaks at 1 for Var̂ = 0.25 (p̂ = 0.5); Var̂ = 0 gives exp(−3.125) ≈ 0.0439.
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    return math.exp(-((var - 0.25) ** 2) / sigma)


def wist_challenger_reward(valid: bool, var: float | None, sigma: float = WIST_SIGMA,
                           invalid_penalty: float = WIST_INVALID_PENALTY) -> float:
    """WIST Eq. 14: Gaussian variance reward for (q_i, y*_i) ∈ Q(d), else ρ (ρ = −0.1 < 0)."""
    if not valid or var is None:
        return invalid_penalty
    return gaussian_variance_reward(var, sigma)


def wist_document_is_learnable(valid_variances: Sequence[float]) -> bool:
    """WIST §3.4: "If all valid QA pairs satisfy Var̂_i = 0 … we skip policy updates for this
    document." False when every valid QA has zero variance (also when there is none)."""
    return any(v > 0 for v in valid_variances)


# ------------------------------------------------------------------ R-Zero

def uncertainty_reward(p: float, kind: str = "paper") -> float:
    """Questioner uncertainty reward on the solver's self-consistency p (R-Zero).

    ``kind="paper"``: r_unc = 1 − 2|p − ½| (R-Zero paper; peaks at 1 for p = ½).
    ``kind="reference"``: min(p, 1 − p) (R-Zero's reference code; peaks at ½) — also the
    uncertainty term of R-Quest's questioner reward.
    """
    if kind == "paper":
        return 1.0 - 2.0 * abs(p - 0.5)
    if kind in ("reference", "min"):
        return min(p, 1.0 - p)
    raise ValueError(f"unknown uncertainty kind '{kind}' (paper or reference)")


def _ngram_counts(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu(hypothesis: Sequence[str], reference: Sequence[str], max_n: int = 4,
                  epsilon: float = 0.1) -> float:
    """Sentence BLEU of token lists with uniform weights 1/N (N = 4) and "method1" smoothing.

    BLEU = BP · exp(Σ_n ¼ log p_n), p_n = clipped n-gram matches / max(1, #hypothesis n-grams),
    BP = 1 if c > r else exp(1 − r/c) (0 when c = 0); a p_n with no match is replaced by ε / its
    denominator (ε = 0.1, Chen & Cherry 2014 method 1); no unigram match at all gives 0. This is
    exactly NLTK's ``sentence_bleu(..., smoothing_function=SmoothingFunction().method1)``, which
    R-Zero's reference code uses, written out so sptool needs no NLTK.
    """
    hyp_len, ref_len = len(hypothesis), len(reference)
    numerators, denominators = [], []
    for n in range(1, max_n + 1):
        hyp_counts = _ngram_counts(hypothesis, n) if hyp_len >= n else Counter()
        ref_counts = _ngram_counts(reference, n)
        clipped = sum(min(count, ref_counts[gram]) for gram, count in hyp_counts.items())
        numerators.append(clipped)
        denominators.append(max(1, sum(hyp_counts.values())))
    if numerators[0] == 0:
        return 0.0
    if hyp_len > ref_len:
        brevity = 1.0
    elif hyp_len == 0:
        brevity = 0.0
    else:
        brevity = math.exp(1.0 - ref_len / hyp_len)
    log_sum = 0.0
    for num, den in zip(numerators, denominators):
        precision = (num + epsilon) / den if num == 0 else num / den
        log_sum += math.log(precision) / max_n
    return brevity * math.exp(log_sum)


def bleu_distance_matrix(questions: Sequence[str], pairing: str = "mean"):
    """R-Zero's distance d_ij = 1 − BLEU(x_i, x_j) on whitespace tokens; d_ii = 0 and identical
    strings have distance 0.

    BLEU is not symmetric. ``pairing="mean"`` (default) uses ½(BLEU(x_i|x_j) + BLEU(x_j|x_i)),
    so penalties do not depend on the order of the batch; ``pairing="reference"`` uses
    BLEU(hypothesis = x_i, reference = x_j) for i < j and mirrors it, as R-Zero's code does.

    Near-linear in the batch's n-grams: the clipped n-gram matches of every pair at once, from an
    inverted index (a sparse question × n-gram count matrix C, min(a, b) = Σ_t [a ≥ t][b ≥ t], so
    the matches are Σ_t B_t B_tᵀ with B_t = [C ≥ t], a sparse product over shared n-grams only);
    then :func:`sentence_bleu`'s formula on whole arrays. 512 questions × 400 words: seconds,
    where the pairwise loop took 274–280 s (``benchmarks/bleu_penalty.py``). Without scipy it
    falls back to the pairwise loop (:func:`bleu_distance_matrix_pairwise`).
    """
    if pairing not in ("mean", "reference"):
        raise ValueError(f"unknown BLEU pairing '{pairing}' (mean or reference)")
    try:
        from scipy import sparse  # noqa: F401
    except ImportError:  # pragma: no cover - scipy comes with the ML stack
        return bleu_distance_matrix_pairwise(questions, pairing)
    return _bleu_distance_matrix_indexed(questions, pairing)


def _clipped_matches(tokens: list[list[str]], max_n: int = 4):
    """``[M_1 … M_N]``: M_n[i, j] = Σ_g min(count_i(g), count_j(g)) over the n-grams g (symmetric).

    Words become integer ids and each n-gram the id of its ((n−1)-gram id, last word id) pair
    (``np.unique``), so no Python loop runs per n-gram."""
    import numpy as np
    from scipy import sparse

    size = len(tokens)
    vocabulary: dict[str, int] = {}
    words = [np.array([vocabulary.setdefault(w, len(vocabulary)) for w in t], dtype=np.int64) for t in tokens]
    lengths = np.array([len(w) for w in words], dtype=np.int64)
    flat = np.concatenate(words) if size else np.zeros(0, dtype=np.int64)
    document = np.repeat(np.arange(size, dtype=np.int64), lengths)
    position = np.arange(len(flat), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    previous = flat  # [k]: the id of the (n−1)-gram starting at flat position k (where there is one)
    matches = []
    for n in range(1, max_n + 1):
        starts = np.flatnonzero(position + n <= lengths[document])
        if n == 1:
            ids = flat
        else:
            keys = previous[starts] * (len(vocabulary) + 1) + flat[starts + n - 1]
            ids = np.full(len(flat), -1, dtype=np.int64)
            ids[starts] = np.unique(keys, return_inverse=True)[1].reshape(-1)
        previous = ids
        total = np.zeros((size, size), dtype=np.int64)
        if len(starts):
            grams = int(ids[starts].max()) + 1
            keys, counts = np.unique(document[starts] * grams + ids[starts], return_counts=True)
            table = sparse.csc_matrix((counts.astype(np.int64), (keys // grams, keys % grams)),
                                      shape=(size, grams))
            table = table[:, np.flatnonzero(np.diff(table.indptr) >= 2)].tocsr()  # shared n-grams
            while table.nnz:  # min(a, b) = Σ_t [a ≥ t][b ≥ t]
                present = table.copy()
                present.data = np.ones_like(present.data)
                total += (present @ present.T).toarray()
                table.data -= 1
                table.eliminate_zeros()
        matches.append(total)
    return matches


def _bleu_distance_matrix_indexed(questions: Sequence[str], pairing: str):
    import numpy as np

    size = len(questions)
    if size == 0:
        return []
    tokens = [q.split() for q in questions]
    lengths = np.array([len(t) for t in tokens], dtype=float)
    matches = _clipped_matches(tokens)
    hyp = lengths[:, None] * np.ones((1, size))   # [i, j]: hypothesis i, reference j
    ref = np.ones((size, 1)) * lengths[None, :]
    epsilon, max_n = 0.1, len(matches)
    log_sum = np.zeros((size, size))
    with np.errstate(divide="ignore", invalid="ignore"):
        for n, numerator in enumerate(matches, start=1):
            denominator = np.maximum(1.0, hyp - n + 1)
            precision = np.where(numerator == 0, epsilon / denominator, numerator / denominator)
            log_sum += np.log(precision) / max_n
        brevity = np.where(hyp > ref, 1.0, np.where(hyp == 0, 0.0, np.exp(1.0 - ref / np.where(hyp == 0, 1.0, hyp))))
        score = np.where(matches[0] == 0, 0.0, brevity * np.exp(log_sum))  # score[i, j] = BLEU(x_i | x_j)
    if pairing == "reference":
        upper = np.triu(score, 1)
        pair = upper + upper.T
    else:
        pair = 0.5 * (score + score.T)
    same: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        same.setdefault(question, []).append(index)
    for indices in same.values():
        if len(indices) > 1:
            pair[np.ix_(indices, indices)] = 1.0
    dist = 1.0 - pair
    np.fill_diagonal(dist, 0.0)
    return dist.tolist()


def bleu_distance_matrix_pairwise(questions: Sequence[str], pairing: str = "mean") -> list[list[float]]:
    """:func:`bleu_distance_matrix` one pair at a time with :func:`sentence_bleu` (quadratic in
    the batch: the reference the indexed version is tested against, and the fallback)."""
    tokens = [q.split() for q in questions]
    n = len(questions)
    dist = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if questions[i] == questions[j]:
                score = 1.0
            elif pairing == "reference":
                score = sentence_bleu(tokens[i], tokens[j])
            else:
                score = 0.5 * (sentence_bleu(tokens[i], tokens[j]) + sentence_bleu(tokens[j], tokens[i]))
            dist[i][j] = dist[j][i] = 1.0 - score
    return dist


def average_linkage_clusters(dist: Sequence[Sequence[float]],
                             threshold: float = BLEU_DISTANCE_THRESHOLD) -> list[int]:
    """Agglomerative clustering with average linkage (UPGMA) on a precomputed distance matrix,
    merging while the closest pair of clusters is nearer than ``threshold``; returns a cluster
    label per item (labels numbered by first appearance).

    Average linkage: d(A ∪ B, C) = (|A| d(A, C) + |B| d(B, C)) / (|A| + |B|) (Lance–Williams).
    A merge happens only at distance < threshold, like scikit-learn's
    ``AgglomerativeClustering(distance_threshold=0.5, linkage="average", metric="precomputed")``
    in R-Zero's code (equal to scipy's ``fcluster(linkage(..., "average"), t, "distance")``
    except at exact ties with t). Written with numpy so no scipy/sklearn dependency is needed.
    """
    import numpy as np

    n = len(dist)
    if n == 0:
        return []
    matrix = np.array(dist, dtype=float).reshape(n, n)  # a copy: the caller's matrix is kept
    np.fill_diagonal(matrix, np.inf)
    sizes = np.ones(n)
    active = np.ones(n, dtype=bool)
    members = {i: [i] for i in range(n)}
    while active.sum() > 1:
        masked = np.where(active[:, None] & active[None, :], matrix, np.inf)
        flat = int(np.argmin(masked))
        a, b = divmod(flat, n)
        if not masked[a, b] < threshold:
            break
        merged = (sizes[a] * matrix[a] + sizes[b] * matrix[b]) / (sizes[a] + sizes[b])
        matrix[a, :] = merged
        matrix[:, a] = merged
        matrix[a, a] = np.inf
        sizes[a] += sizes[b]
        active[b] = False
        matrix[b, :] = np.inf
        matrix[:, b] = np.inf
        members[a].extend(members.pop(b))
    labels = [0] * n
    order = sorted(members.values(), key=min)
    for label, group in enumerate(order):
        for index in group:
            labels[index] = label
    return labels


def bleu_repetition_penalties(questions: Sequence[str], threshold: float = BLEU_DISTANCE_THRESHOLD,
                              pairing: str = "mean") -> list[float]:
    """R-Zero repetition penalty: r_rep(x_i) = |C_k| / B for the cluster C_k holding x_i, with
    clusters from average-linkage agglomerative clustering on d_ij = 1 − BLEU(x_i, x_j) and
    distance threshold 0.5; B is the number of questions clustered (the batch). λ = 1 as in
    R-Zero's code. Empty batch → []; a lone question → [1.0].
    """
    if not questions:
        return []
    labels = average_linkage_clusters(bleu_distance_matrix(questions, pairing), threshold)
    sizes = Counter(labels)
    return [sizes[label] / len(questions) for label in labels]


def rzero_questioner_reward(p: float | None, repetition_penalty: float, parsed: bool = True,
                            uncertainty: str = "paper", clip_at_zero: bool = False,
                            format_failure: float = FORMAT_FAILURE_REWARD) -> float:
    """R-Zero questioner reward: r_i = r_unc(x_i) − r_rep(x_i); −1 when the output cannot be
    parsed (no ``<question>``; WIST Table: R-Zero invalid penalty −1 for the Challenger).

    ``clip_at_zero`` applies max(0, r_unc − r_rep) as written in the R-Zero paper; the default
    (no floor) follows R-Zero's reference code.
    """
    if not parsed or p is None:
        return format_failure
    reward = uncertainty_reward(p, uncertainty) - repetition_penalty
    return max(0.0, reward) if clip_at_zero else reward


def in_band(value: float | None, band: tuple[float, float], inclusive: bool = True) -> bool:
    """value ∈ [lo, hi] (``inclusive``) or value ∈ (lo, hi); None is never in a band."""
    if value is None:
        return False
    lo, hi = band
    return lo <= value <= hi if inclusive else lo < value < hi


def pseudo_label_solver_reward(correct: bool | None, formatted: bool,
                               format_weight: float = PSEUDO_LABEL_FORMAT_WEIGHT) -> float:
    """Solver reward on pseudo-labelled questions (R-Quest "solver 奖励"; R-Zero §2.1):
    r = 0.9 · 1[answer ≡ majority pseudo-label] + 0.1 · 1[format: a \\boxed{} answer].

    ``format_weight`` w gives (1 − w)·correct + w·format; w = 0 is plain binary correctness.
    """
    return (1.0 - format_weight) * (1.0 if correct else 0.0) + format_weight * (1.0 if formatted else 0.0)


def rzero_solver_reward(correct: bool | None, formatted: bool,
                        format_weight: float = PSEUDO_LABEL_FORMAT_WEIGHT) -> float:
    """R-Zero solver reward 0.9·correct + 0.1·format (see :func:`pseudo_label_solver_reward`)."""
    return pseudo_label_solver_reward(correct, formatted, format_weight)


def keep_for_solver_training(p: float | None, majority: str | None,
                             band: tuple[float, float] = RZERO_SOLVER_BAND) -> bool:
    """R-Zero / R-Quest solver data: keep a question when 0.3 ≤ p ≤ 0.8 (p = s, the majority
    fraction) and the majority answer is non-empty."""
    return in_band(p, band) and bool(majority and str(majority).strip())


# ------------------------------------------------------------------ R-Quest

def validity_gate(u: float) -> float:
    """R-Quest validity gate: g_valid(q) = ½ − u(q), u = share of INVALID answers among the
    validity-mode samples (9 by default). The question is invalid when g_valid < 0 (more than
    half the answers are INVALID); u = ½ still passes."""
    return 0.5 - u


def passes_validity_gate(u: float) -> bool:
    """R-Quest: valid iff g_valid(q) = ½ − u(q) ≥ 0."""
    return validity_gate(u) >= 0


def rquest_questioner_reward(u: float | None, s: float | None, novel: bool | None,
                             parsed: bool = True,
                             format_failure: float = FORMAT_FAILURE_REWARD) -> float:
    """R-Quest questioner reward:

    - format failure (unparsable generation): −1;
    - g_valid(q) = ½ − u(q) < 0 (invalid): the reward is g_valid(q) itself (negative);
    - otherwise g_novel(q) · min{s(q), 1 − s(q)}, s = share of the largest answer class among the
      math-mode samples (10 by default), g_novel ∈ {0, 1} (``None``: no novelty verdict, taken
      as novel).
    """
    if not parsed or u is None:
        return format_failure
    gate = validity_gate(u)
    if gate < 0:
        return gate
    if s is None:
        raise ValueError("s (math-mode majority fraction) is needed for a question that passes the validity gate")
    novelty_gate = 0.0 if novel is False else 1.0
    return novelty_gate * uncertainty_reward(s, "reference")


def validity_init_reward(answer: str | None, *, problem_invalid: bool, correct: bool | None,
                         false_rejection_penalty: float = 0.5, empty_box: float = -0.1) -> float:
    """R-Quest validity-initialisation reward:
    R_init(q, a) = 1[a = a*(q)] − λ · 1[a = INVALID ∧ a*(q) ≠ INVALID], λ = 0.5, and −0.1 for
    an empty answer box.

    ``answer`` is the sample's extracted final answer (None: no or empty ``\\boxed{}``, → −0.1);
    ``problem_invalid``: the labelled answer a*(q) is INVALID (a flawed problem);
    ``correct``: the answer is equivalent to a*(q) on a valid problem (math-verify).
    So: 1 for a correct answer or a correct INVALID, −0.5 for rejecting a valid problem, 0 for
    anything else (a wrong answer, or answering a flawed problem).
    """
    if answer is None or not str(answer).strip():
        return empty_box
    said_invalid = str(answer).strip().upper() == "INVALID"
    if problem_invalid:
        return 1.0 if said_invalid else 0.0
    if said_invalid:
        return -false_rejection_penalty
    return 1.0 if correct else 0.0


# ------------------------------------------------------------------ SvS

def rewards_differ(rewards: Sequence[float]) -> bool:
    """Does the group carry a policy gradient? Its advantages r_i − mean(r) (Dr. GRPO) are all
    zero exactly when every reward is equal. For binary rewards this is SvS Algorithm 1 line 8:
    a problem trains the solver when 0 < Acc(x) < 1."""
    return len(rewards) > 1 and max(rewards) > min(rewards)


def svs_is_underperforming(acc: float | None,
                           band: tuple[float, float] = SVS_UNDERPERFORMING_BAND, *,
                           strict: bool = False) -> bool:
    """SvS §3.3: a challenging problem has Acc(x) ∈ [acc_l, acc_h] = [12.5%, 50%] (§4); its
    correct solutions feed variational problem synthesis.

    §3.3 writes the closed range [acc_l, acc_h]; Algorithm 1 line 11 writes
    acc_l < Acc(x) < acc_h (``strict=True``).
    """
    return in_band(acc, band, inclusive=not strict)


def synthesis_reward(acc: float | None, band: tuple[float, float] = SVS_SYNTHESIS_BAND,
                     negative: bool = False, negative_value: float = -1.0) -> float:
    """SvS Eq. 6: R_v(x̂) = 1(âcc_l ≤ Acc(x̂, a) ≤ âcc_h), [âcc_l, âcc_h] = [12.5%, 62.5%].

    Eq. 6 and Algorithm 1 (line 24) give 0 outside the band (default). The text beside
    Figure 4 says a variant that is fully solved or never solved "receives a negative reward"
    without giving a value: ``negative=True`` returns ``negative_value`` (−1 unless set)
    outside the band. A variant without an accuracy (unparsable, unsolved) is outside the band.
    """
    if in_band(acc, band):
        return 1.0
    return negative_value if negative else 0.0


def svs_keep_synthesis_group(accuracies: Sequence[float | None],
                             band: tuple[float, float] = SVS_SYNTHESIS_BAND) -> bool:
    """SvS Algorithm 1 lines 21–22: keep the synthesis group of a solution when |J_2| > 0, i.e.
    some variant's accuracy is in the positive synthesis band."""
    return any(in_band(acc, band) for acc in accuracies)


# ------------------------------------------------------------------ advantages

def group_advantages(rewards: Sequence[float], kind: str = "dr_grpo",
                     epsilon: float = GRPO_EPSILON) -> list[float]:
    """Group-relative advantages of one group of completions of the same prompt.

    ``dr_grpo`` (default; WIST Eq. 3, Dr. GRPO): A_i = r_i − (1/G) Σ_j r_j.
    ``grpo`` (SvS Eq. 2 / DeepSeekMath): A_i = (r_i − mean(r)) / (std(r) + ε), with the sample
    standard deviation (Bessel-corrected, as torch.std in TRL/verl; 0 for a single completion)
    and ε = 1e-6.
    Empty group → []; a group of equal rewards → all zeros.
    """
    values = [float(r) for r in rewards]
    if not values:
        return []
    mean = sum(values) / len(values)
    centred = [r - mean for r in values]
    if kind == "dr_grpo":
        return centred
    if kind == "grpo":
        if len(values) > 1:
            std = math.sqrt(sum(c * c for c in centred) / (len(values) - 1))
        else:
            std = 0.0
        return [c / (std + epsilon) for c in centred]
    raise ValueError(f"unknown advantage kind '{kind}' (dr_grpo or grpo)")
