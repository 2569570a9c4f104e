"""Micro-batches by token budget, padding-free packing and token logprobs.

A step's rows are split greedily, in order, into micro-batches whose real
token count fits `micro_batch_tokens` (a row longer than the budget gets a
micro-batch of its own). Each micro-batch runs the model either

- packed: the real tokens of every row concatenated into one (1, L) sequence,
  `position_ids` restarting at 0 for each row; HF builds a block-diagonal
  causal mask from those position ids, so no FLOP is spent on padding; or
- padded: the rows as they are, minus the columns that are padding in every row.

Either way the per-token outputs are scattered back onto the (b, T) grid of
the batch, so the loss always sees the layout of `nexrl.types` and
aggregation (which may depend on T) is identical in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nexrl.training.parallel import all_reduce_sum
from nexrl.training.vocab_projection import projected_logprobs


def split_by_tokens(attention_mask: torch.Tensor, budget: int) -> list[list[int]]:
    """Row indices of each micro-batch; real tokens per micro-batch <= budget (or one row)."""
    lengths = attention_mask.sum(-1).tolist()  # (B,)
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += int(n)
    if current:
        groups.append(current)
    return groups


@dataclass
class ModelInputs:
    """What the model sees for one micro-batch, and how to map outputs back."""

    input_ids: torch.Tensor  # (1, L) packed or (b, T') padded
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: torch.Tensor | None  # None when packed
    grid_mask: torch.Tensor  # (b, T) bool, real tokens of the micro-batch
    packed: bool


def make_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool) -> ModelInputs:
    """Model inputs for rows `input_ids` (b, T) with `attention_mask` (b, T)."""
    grid = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, T)
    if packed:
        return ModelInputs(
            input_ids=input_ids[grid][None],  # (1, L)
            position_ids=positions[grid][None],
            attention_mask=None,
            grid_mask=grid,
            packed=True,
        )
    width = int(grid.any(0).nonzero().max()) + 1 if grid.any() else 1
    return ModelInputs(
        input_ids=input_ids[:, :width],
        position_ids=positions[:, :width],
        attention_mask=attention_mask[:, :width].long(),
        grid_mask=grid,
        packed=False,
    )


def token_logprobs(
    logits: torch.Tensor,  # (N, L, V)
    inputs: ModelInputs,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, T) logprob of each token given its prefix (0 at each row start / off-mask).

    Differentiable; computed in float32 via logsumexp (no (L, V) log_softmax copy).
    Entropy at t is the entropy of the distribution that predicted token t.
    """
    ids = inputs.input_ids
    pred = logits[:, :-1].float()  # (N, L-1, V) predicts ids[:, 1:]
    lse = torch.logsumexp(pred, dim=-1)  # (N, L-1)
    picked = pred.gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = inputs.position_ids[:, 1:] > 0  # a row start has no prediction
    lp = torch.nn.functional.pad((picked - lse) * valid, (1, 0))  # (N, L)
    ent = None
    if with_entropy:
        probs = torch.softmax(pred, dim=-1)
        ent_next = lse - (probs * pred).sum(-1)
        ent = torch.nn.functional.pad(ent_next * valid, (1, 0))
    return to_grid(lp, inputs), (to_grid(ent, inputs) if ent is not None else None)


def to_grid(values: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """Scatter per-token model outputs onto the (b, T) grid, zeros off-mask (differentiable)."""
    grid = inputs.grid_mask
    if inputs.packed:
        flat = values[0]  # (L,)
    else:
        width = values.shape[1]
        flat = values[grid[:, :width]]
    out = values.new_zeros(grid.shape)
    return out.masked_scatter(grid, flat)


def chunked_token_logprobs(
    hidden: torch.Tensor,  # (N, L, H) final hidden states (after the last norm)
    head: torch.Tensor,  # (V, H) output projection
    inputs: ModelInputs,
    select: torch.Tensor | None = None,  # (b, T) bool: tokens whose logprob is wanted
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` from hidden states, without the (N, L, V) logits tensor.

    Only the tokens in `select` (default: every real token) are projected onto the
    vocabulary, `chunk_tokens` rows at a time, in float32. With autograd on, backward
    recomputes each chunk's (rows, V) logits instead of keeping them
    (`vocab_projection.py`): peak memory holds one chunk of logits, not T x V.
    Tokens off `select` get 0, like positions off the mask.
    """
    ids = inputs.input_ids
    want = inputs.position_ids[:, 1:] > 0  # (N, L-1): token t+1 has a prediction at t
    if select is not None:
        want = want & _to_model_layout(select, inputs)[:, 1:]
    rows = hidden[:, :-1][want]  # (M, H) hidden state that predicts each wanted token
    targets = ids[:, 1:][want]  # (M,)
    lp_flat, ent_flat = project_rows(rows, head, targets, with_entropy, chunk_tokens)
    lp = _scatter(lp_flat, want)
    ent = to_grid(_scatter(ent_flat, want), inputs) if with_entropy else None
    return to_grid(lp, inputs), ent


def project_rows(
    rows: torch.Tensor,  # (M, H) hidden states, one per wanted prediction
    head: torch.Tensor,  # (V, H) output projection
    targets: torch.Tensor,  # (M,) the token each row predicts
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M,) float32 logprob of each target (and (M,) entropy; empty when not asked),
    `chunk_tokens` rows at a time, each chunk recomputed in backward (see above)."""
    step = chunk_tokens if chunk_tokens > 0 else max(rows.shape[0], 1)
    pieces = [
        _chunk(rows[i : i + step], head, targets[i : i + step], with_entropy)
        # at least one (maybe empty) chunk: the result stays connected to the graph
        for i in range(0, max(rows.shape[0], 1), step)
    ]
    lp = torch.cat([p[0] for p in pieces]).float()
    return lp, torch.cat([p[1] for p in pieces]).float()


def _chunk(rows, head, targets, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and (rows.requires_grad or head.requires_grad):
        return projected_logprobs(rows, head, targets, with_entropy)
    return _project(rows, head, targets, with_entropy)


def _project(rows, head, targets, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (rows @ head.T).float()  # (n, V)
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, lp.new_zeros(0)
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return lp, ent


def _scatter(values: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """(M,) values of the wanted predictions -> (N, L) with 0 at t=0 and elsewhere."""
    out = values.new_zeros(want.shape).masked_scatter(want, values)
    return torch.nn.functional.pad(out, (1, 0))


def _to_model_layout(select: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """A (b, T) grid mask in the layout the model ran: (1, L) packed or (b, T') padded."""
    select = select.bool() & inputs.grid_mask
    if inputs.packed:
        return select[inputs.grid_mask][None]
    return select[:, : inputs.input_ids.shape[1]]


SUMMED_METRICS = ("loss", "entropy")  # plus every name ending in "_loss"


def accumulate_metrics(sums, loss, metrics, tokens: float) -> None:
    """Add a micro-batch's loss and metrics to `sums` (summed or token-weighted)."""
    sums["loss"] += float(loss.detach())
    sums["_tokens"] += tokens
    for name, value in metrics.items():
        v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if name in SUMMED_METRICS or name.endswith("_loss"):
            sums[name] += v
        else:
            sums[f"_w_{name}"] += v * tokens


def reduce_metrics(
    sums: dict[str, float], global_tokens: float, device: torch.device
) -> dict[str, float]:
    """Sum normalised losses over ranks; token-weighted mean of the other metrics."""
    names = sorted(sums)
    reduced = all_reduce_sum(
        torch.tensor([sums[n] for n in names], dtype=torch.float64, device=device)
    )
    out: dict[str, float] = {}
    for name, value in zip(names, reduced.tolist(), strict=True):
        if name.startswith("_w_"):
            out[name[3:]] = value / max(global_tokens, 1.0)
        elif not name.startswith("_"):
            out[name] = value
    return out


def all_reduce_max(n: int, device: torch.device) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return n
    t = torch.tensor([n], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
