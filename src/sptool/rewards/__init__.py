"""Every reward and gate formula of the four recipes, as pure functions, in one package.

Each function cites the equation it implements. Sources (the papers' sections):

- WIST: web-grounded iterative self-play tree (§2.2 Eq. 3, §3.4 Eqs. 12–14, role balancing)
- SvS: self-play with variational problem synthesis, Liang et al., 2025 (§3.3 Eqs. 4–6, Algorithm 1)
- R-Quest: R-Zero plus validity and novelty gates (validity initialisation, validity gate, novelty gate,
  questioner reward, solver data, replay)
- R-Zero (Huang et al., 2025, arXiv 2508.05004) as summarised in the WIST and
  R-Quest papers; where R-Zero's reference code differs, the alternative is a keyword option.

Nothing here reads records or files: inputs are numbers, booleans and strings, so every formula
can be tested against values computed by hand.

One module per paper or kind: :mod:`.wist`, :mod:`.rzero` (with its BLEU repetition penalty in
:mod:`.bleu`), :mod:`.rquest`, :mod:`.svs`, :mod:`.advantages` and :mod:`.bands` (the band test
they share). Every public name is importable from ``sptool.rewards`` itself
(``from sptool import rewards as R; R.group_advantages(...)``).
"""

from __future__ import annotations

from sptool.rewards.wist import (  # noqa: F401
    WIST_SIGMA,
    WIST_INVALID_PENALTY,
    binary_correctness_reward,
    empirical_accuracy,
    empirical_variance,
    gaussian_variance_reward,
    wist_challenger_reward,
    wist_document_is_learnable,
)
from sptool.rewards.bleu import (  # noqa: F401
    BLEU_DISTANCE_THRESHOLD,
    sentence_bleu,
    bleu_distance_matrix,
    bleu_distance_matrix_pairwise,
    average_linkage_clusters,
    bleu_repetition_penalties,
)
from sptool.rewards.bands import (  # noqa: F401
    in_band,
)
from sptool.rewards.rzero import (  # noqa: F401
    FORMAT_FAILURE_REWARD,
    RZERO_SOLVER_BAND,
    PSEUDO_LABEL_FORMAT_WEIGHT,
    uncertainty_reward,
    rzero_questioner_reward,
    pseudo_label_solver_reward,
    rzero_solver_reward,
    keep_for_solver_training,
)
from sptool.rewards.rquest import (  # noqa: F401
    validity_gate,
    passes_validity_gate,
    rquest_questioner_reward,
    validity_init_reward,
)
from sptool.rewards.svs import (  # noqa: F401
    SVS_UNDERPERFORMING_BAND,
    SVS_SYNTHESIS_BAND,
    rewards_differ,
    svs_is_underperforming,
    synthesis_reward,
    svs_keep_synthesis_group,
)
from sptool.rewards.advantages import (  # noqa: F401
    GRPO_EPSILON,
    group_advantages,
)
