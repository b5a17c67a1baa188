"""R-Zero's repetition penalty: sentence BLEU, the batch's BLEU distance matrix (indexed and
pairwise), average-linkage clustering on it, and the cluster-size penalty."""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

BLEU_DISTANCE_THRESHOLD = 0.5


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
