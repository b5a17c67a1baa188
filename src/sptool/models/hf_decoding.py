"""The ``hf`` backend's decoding helpers, handed to transformers' ``generate``: the static path's
shape buckets (rows padded to a power of two, cache lengths to a multiple of 64), the stopping
criteria that report progress and finish padding rows, the logits processor that gathers
sampling log-probabilities one step at a time, the switch that runs a trainer's regionally
compiled layers plainly while generating, and the packed parts of split-rounded linears for a
sampler's call."""

from __future__ import annotations

ROW_BUCKET_MIN = 8      # the smallest padded batch of the static path
LENGTH_BUCKET = 64      # static cache lengths are multiples of this


def bucket_rows(rows: int, batch_size: int) -> int:
    """The padded row count of a static-cache batch of ``rows`` sequences: the next power of two
    (at least :data:`ROW_BUCKET_MIN`), never above ``batch_size`` (nor below ``rows``)."""
    bucket = ROW_BUCKET_MIN
    while bucket < rows:
        bucket *= 2
    return max(rows, min(bucket, batch_size))


def bucket_length(tokens: int) -> int:
    """The static cache length for ``tokens`` positions (prompt + new tokens): the next multiple
    of :data:`LENGTH_BUCKET`."""
    return max(1, -(-tokens // LENGTH_BUCKET)) * LENGTH_BUCKET


class TokenProgress:
    """A stopping criterion that never stops: it tells ``listener`` after every decoding step how
    many real rows got a new token (the progress of a long generation; padding rows not counted)."""

    def __init__(self, listener, rows: int):
        self.listener, self.real_rows = listener, rows

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.listener(self.real_rows)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class FinishedRows:
    """A stopping criterion that finishes the static path's padding rows (a fixed mask: no
    host-device synchronisation), so they never keep a call decoding."""

    def __init__(self, done):
        self.done = done

    def __call__(self, input_ids, scores, **kwargs):
        return self.done


class LogprobRecorder:
    """A logits processor, first in line: at each step it keeps the raw logits and their
    log-normaliser, and gathers the previous step's sampled token (now the last input id) from
    the previous step's logits. So one step's logits are held at a time; :meth:`rows` adds the
    last step's token and returns the per-row log-probabilities (under the raw logits)."""

    def __init__(self):
        self.gathered: list = []  # (rows,) float32 per generated token but the last
        self.last = None  # (raw logits, logsumexp) of the latest step

    def _gather(self, tokens):
        logits, normaliser = self.last
        return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.gathered.append(self._gather(input_ids[:, -1]))
        raw = scores.float()
        self.last = (raw, raw.logsumexp(dim=-1))
        return scores

    def rows(self, new_tokens) -> list[list[float]]:
        """Log-probabilities of ``new_tokens`` (the real rows x the generated tokens)."""
        import torch

        real, steps = new_tokens.shape
        columns = [column[:real] for column in self.gathered[:steps]]
        if len(columns) < steps and self.last is not None:
            logits, normaliser = self.last
            token = new_tokens[:, len(columns)].to(logits.device)
            columns.append(logits[:real].gather(-1, token.unsqueeze(-1)).squeeze(-1) - normaliser[:real])
        self.gathered, self.last = [], None
        if not columns:
            return [[] for _ in range(real)]
        return torch.stack(columns, dim=1).tolist()


class regional_compile_off:
    """The trainer's regionally compiled modules (``nn.Module.compile()``: its decoder layers on
    CUDA) run their plain forward while generating: compiled for training, the layers' one
    compiled forward would otherwise recompile for each cache layer it is handed (dynamo guards
    on the cache layer; seen on CPU with a static cache: dynamo's recompile limit of 8 hit in the
    first prefill), a limit it shares with the training graphs. The compiled decoding step, when
    on, traces the plain layers itself."""

    def __init__(self, model):
        self.model, self.saved = model, []

    def __enter__(self):
        for module in self.model.modules():
            compiled = getattr(module, "_compiled_call_impl", None)
            if compiled is not None:
                self.saved.append((module, compiled))
                module._compiled_call_impl = None
        return self

    def __exit__(self, *exc):
        for module, compiled in self.saved:
            module._compiled_call_impl = compiled
        self.saved = []
        return False


#: children of one module that multiply the same input (by name: a Llama-family attention's query,
#: key and value projections, its MLP's gate and up projections): a sampler's call multiplies each
#: set as one GEMM (:class:`SiblingGEMM`)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGEMM:
    """Split-rounded linears of one module that multiply the same input, as one GEMM in a sampler's
    call: their packed ``[hi | lo]`` rows stacked in one tensor (:attr:`packed`; each layer's
    ``split_packed`` is a view of its rows, so packing a layer writes there), their biases in one.

    The first of them called with an input computes every member's output in one GEMM; the others,
    called with that same tensor (``is``: the attention's ``q_proj(x)``, ``k_proj(x)``,
    ``v_proj(x)``), return their part of it. A member called with another tensor starts again, so
    the result never depends on the order of the calls. At 512 rows a decoding step's GEMMs are
    bound by their count: a Llama layer's seven GEMMs become four."""

    def __init__(self, members, packed, bias):
        self.members, self.packed, self.bias = list(members), packed, bias
        self.sizes = [member.out_features for member in self.members]
        starts = [sum(self.sizes[:index]) for index in range(len(self.sizes))]
        self.rows = [slice(start, start + size) for start, size in zip(starts, self.sizes)]  # each member's
        self.pending = None  # (input, every member's output, members yet to take theirs)

    def output(self, index: int, x, multiply):
        """Member ``index``'s output for input ``x``; ``multiply(x, packed, bias)`` is the split
        rounding's packed GEMM (``sptool.train.rounding.packed_linear``, which routes the layers)."""
        pending = self.pending
        if pending is None or pending[0] is not x:
            outputs = multiply(x, self.packed, self.bias).split(self.sizes, dim=-1)
            pending = (x, outputs, len(self.members))
        left = pending[2] - 1
        self.pending = (x, pending[1], left) if left > 0 else None
        return pending[1][index]


def _sibling_sets(model):
    """``(parent, [linears])`` for each :data:`SIBLINGS` set whose members are all split-rounded
    float32 ``nn.Linear`` layers of the same input width and device, with biases on all or none."""
    import torch

    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(member) is torch.nn.Linear and getattr(member, "weight_rounding", None) == "split"
                       and "forward" in vars(member) and member.weight.dtype == torch.float32
                       for member in members):
                continue
            first = members[0].weight
            if any(member.in_features != first.shape[1] or member.weight.device != first.device
                   for member in members):
                continue
            if len({member.bias is None for member in members}) == 1:
                yield parent, members


class packed_split_weights:
    """While entered (a sampler's call, no gradient): every linear of ``model`` routed with the
    ``split`` rounding (:mod:`sptool.train.rounding`: a ``weight_rounding`` attribute of ``"split"``)
    multiplies by its two parts packed side by side, ``[hi | lo]``, made once on entry from the
    current float32 weights, in one GEMM (``sptool.train.rounding.packed_linear``), instead of
    splitting its weight and running two GEMMs at every forward. The same sum; for a decoder that
    runs a step per token at 512 rows, bound by its kernel count, half the GEMMs and no split per
    step. Linears that multiply the same input (:data:`SIBLINGS`) share one packed tensor and one
    GEMM (:class:`SiblingGEMM`). Each layer keeps its packed tensor (``split_packed``: twice the
    weight's elements in the low precision) and refreshes it in place on every entry, so a captured
    CUDA graph reads the weights of the latest update."""

    def __init__(self, model, dtype):
        self.model, self.dtype, self.layers, self.groups = model, dtype, [], []

    def _group(self, members):
        """The kept :class:`SiblingGEMM` of ``members``, or a new one whose stacked tensor their
        ``split_packed`` views (made on the first entry, or when a layer's shape or place changed)."""
        import torch

        kept = getattr(members[0], "split_group", None)
        group = kept[0] if kept else None
        rows = sum(member.out_features for member in members)
        width = 2 * members[0].in_features
        device = members[0].weight.device
        if group is None or group.members != members or group.packed.shape != (rows, width) \
                or group.packed.dtype != self.dtype or group.packed.device != device:
            with torch.inference_mode(False):  # normal tensors: refreshed in or out of inference mode
                packed = torch.empty((rows, width), dtype=self.dtype, device=device)
                bias = None if members[0].bias is None else torch.empty(rows, dtype=torch.float32, device=device)
            torch._dynamo.mark_static_address(packed)  # read in place by compiled CUDA graphs
            if bias is not None:
                torch._dynamo.mark_static_address(bias)
            group = SiblingGEMM(members, packed, bias)
            for index, (member, rows) in enumerate(zip(members, group.rows)):
                member.split_packed = packed[rows]
                member.split_group = (group, index)
        if group.bias is not None:  # one kernel for the set's biases
            torch.cat([member.bias.detach() for member in members], out=group.bias)
        return group

    def __enter__(self):
        import torch

        if self.dtype not in (torch.bfloat16, torch.float16):
            return self
        with torch.no_grad():
            self.groups = [self._group(members) for _, members in _sibling_sets(self.model)]
            grouped = {id(member) for group in self.groups for member in group.members}
            for module in self.model.modules():
                if getattr(module, "weight_rounding", None) != "split" or "forward" not in vars(module):
                    continue
                weight = module.weight.detach()
                if weight.dtype != torch.float32:
                    continue
                out_features, in_features = weight.shape
                packed = getattr(module, "split_packed", None)
                if packed is None or packed.shape != (out_features, 2 * in_features) or packed.dtype != self.dtype \
                        or packed.device != weight.device:
                    with torch.inference_mode(False):  # a normal tensor: refreshed in or out of inference mode
                        packed = module.split_packed = weight.new_empty((out_features, 2 * in_features),
                                                                        dtype=self.dtype)
                    # the same tensor every call: torch.compile's CUDA graphs read it in place, no copy
                    torch._dynamo.mark_static_address(packed)
                if id(module) not in grouped:
                    module.split_group = None
                # two kernels a layer: hi rounded to nearest, then lo = w - hi, computed in float32
                # (the common dtype of the operands) and rounded once into its half
                hi = packed[:, :in_features]
                hi.copy_(weight)
                torch.sub(weight, hi, out=packed[:, in_features:])
                module.split_packed_on = True
                self.layers.append(module)
        return self

    def __exit__(self, *exc):
        for module in self.layers:
            module.split_packed_on = False
        for group in self.groups:
            group.pending = None
        self.layers, self.groups = [], []
        return False
