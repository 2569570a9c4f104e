"""Loading models and new weights into a running engine.

Both engines keep the `transformers` model that `from_pretrained` built and
copy new weights into its parameters in place (`load_weights_into`), so any view
an engine holds on those parameters stays valid. Weights come from a state
dict in memory or from a directory of `*.safetensors` files (an HF
checkpoint); nothing is unpickled.

In-process hand-off: when the trainer and the engine share a process (local
mode, in-process backends) the trainer `publish_in_memory`s each export under the
sync folder's path instead of writing files, and an update naming that path takes
the published state dict (docs/weight_sync.md). A `SharedState` goes further: its
CPU tensors become the engine's parameters (no copy, no second set of weights).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nexrl.inference.protocol import WeightUpdateMeta

_PUBLISHED: dict[str, dict[str, torch.Tensor]] = {}
_PUBLISHED_LOCK = threading.Lock()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model_and_tokenizer(model_path: str | Path, dtype: str | torch.dtype, device: str):
    """`from_pretrained` the causal LM and its tokenizer, in eval mode.

    `model_path` may be an HF directory, a Hub id or a GGUF file (`nexrl.models.sources`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexrl.models.sources import resolve_model

    model_path = resolve_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=resolve_dtype(dtype), attn_implementation="sdpa"
    )
    # (transformers' `to` is wrapped in a decorator whose stub mypy reads as unbound)
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path` (a file path also works)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in weight path {str(path)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _key(path: str | Path) -> str:
    return str(Path(path).resolve())


class SharedState(dict):
    """A state dict whose tensors an engine may take as its own parameters instead of
    copying them: the trainer's own tensors in a sync run in one process, where no
    generation runs while the optimizer changes them. Only contiguous CPU tensors of the
    engine's dtype are taken (a CUDA graph reads fixed addresses); others are copied."""


def publish_in_memory(path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Make `state` what an update from `path` loads in this process (it replaces the
    previous one; its tensors must not change while a push reads them: the train worker
    publishes the trainer's own tensors only where every push ends before its next step)."""
    with _PUBLISHED_LOCK:
        _PUBLISHED[_key(path)] = state


def forget_in_memory(path: str | Path) -> None:
    """Drop what was published under `path` (the run ended)."""
    with _PUBLISHED_LOCK:
        _PUBLISHED.pop(_key(path), None)


def state_to_arrays(state: dict[str, torch.Tensor]) -> dict[str, tuple[Any, str]]:
    """`state` as numpy arrays with their torch dtype names, for a Ray call: Ray moves
    numpy arrays through its object store without pickling them (3.7 vs 9.5 ms for the
    default tiny model's 1.8 MB). bf16, which numpy lacks, travels as int16 bits."""
    out: dict[str, tuple[Any, str]] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        out[name] = (bits.numpy(), str(tensor.dtype).removeprefix("torch."))
    return out


def state_from_arrays(arrays: dict[str, tuple[Any, str]]) -> dict[str, torch.Tensor]:
    """The state dict `state_to_arrays` packed (tensors share the arrays' memory)."""
    state: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # Ray's arrays are read-only; loading copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (array, dtype) in arrays.items():
            tensor = torch.from_numpy(array)
            state[name] = tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
    return state


def state_dict_from_meta(meta: WeightUpdateMeta) -> dict[str, Any]:
    """The update's weights: its state dict, what this process published under its
    path, or the safetensors files at its path."""
    if meta.state_dict is not None:
        return meta.state_dict
    if meta.path is not None:
        with _PUBLISHED_LOCK:
            published = _PUBLISHED.get(_key(meta.path))
        return published if published is not None else read_safetensors_dir(meta.path)
    raise ValueError("WeightUpdateMeta needs `path` or `state_dict`, both are None")


@torch.no_grad()
def load_weights_into(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Copy `state` into `model` in place, in one `_foreach_copy_` (dtypes and devices
    converted as by `copy_`). Unknown keys and shapes that differ from the model's are
    errors; keys may be absent (tied weights, a partial update), but not all of them.

    Why not `load_state_dict`: its per-module Python (prefixes, hooks, checks) took 0.49
    ms for the tiny model's 39 tensors against 0.18 ms here (Zen 4 AMD EPYC), on the
    sync step's critical path once a step (docs/performance.md)."""
    targets = model.state_dict(keep_vars=True)
    unknown = [k for k in state if k not in targets]
    if unknown:
        raise KeyError(f"weight update has unknown keys: {unknown[:5]}")
    if not state:
        raise KeyError("weight update matched no parameter of the model")
    wrong = [
        f"{k}: {tuple(v.shape)} for the model's {tuple(targets[k].shape)}"
        for k, v in state.items()
        if v.shape != targets[k].shape
    ]
    if wrong:
        raise ValueError(f"weight update has tensors of the wrong shape: {wrong[:5]}")
    if isinstance(state, SharedState):
        state = _adopt(targets, state)
    if state:
        torch._foreach_copy_([targets[k].detach() for k in state], list(state.values()))


def _adopt(targets: dict[str, torch.Tensor], state: SharedState) -> dict[str, Any]:
    """Make the CPU tensors of `state` that match their target the model's own (the
    engine's copy of them is freed); return what is left to copy."""
    rest: dict[str, Any] = {}
    for k, v in state.items():
        target = targets[k]
        same = v.dtype == target.dtype and v.device == target.device and v.is_contiguous()
        if same and v.device.type == "cpu" and isinstance(target, torch.nn.Parameter):
            target.data = v
        else:
            rest[k] = v
    return rest


JOINED_PROJECTIONS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
)
"""The linears of a decoder layer that an inference engine multiplies as one matrix."""


@torch.no_grad()
def join_projections(model: torch.nn.Module) -> int:
    """Lay out each decoder layer's q/k/v projections, and its gate/up projections, as
    consecutive row blocks of one tensor (weights and biases apart): the parameters become
    views of it, with the same values (they train as before). The built-in engine then
    multiplies by the joined matrix in place instead of keeping a concatenated copy
    (SmolLM2: 0.26 GiB; nexrl/inference/model_runner.py): the trainer joins its own,
    which an engine in the same process takes as its weights in a sync run
    (`SharedState`). Returns the groups joined."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    joined = 0
    for block in layers if isinstance(layers, torch.nn.ModuleList) else ():
        for parent, names in JOINED_PROJECTIONS:
            found = [getattr(getattr(block, parent, None), name, None) for name in names]
            linears = [m for m in found if isinstance(m, torch.nn.Linear)]
            if len(linears) == len(names):
                joined += _join_rows([linear.weight for linear in linears])
                biases = [linear.bias for linear in linears if linear.bias is not None]
                if len(biases) == len(names):
                    _join_rows(biases)
    return joined


def _join_rows(params: Sequence[torch.Tensor]) -> int:
    if len({(p.dtype, p.device, p.shape[1:]) for p in params}) > 1:
        return 0
    block = torch.cat([p.detach() for p in params])
    offset = 0
    for p in params:
        p.data = block[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return 1


def cat_rows(*ts: torch.Tensor | None) -> torch.Tensor | None:
    """Biases joined along rows (`join_rows`; None: none of them, zeros for a missing one)."""
    if all(t is None for t in ts):
        return None
    return join_rows(*(t if t is not None else torch.zeros(0) for t in ts))


def join_rows(*ts: torch.Tensor) -> torch.Tensor:
    """`ts` joined along rows. Tensors that already are consecutive row blocks of one
    tensor (`join_projections`) give the view over them: the engine then
    multiplies by the trainer's tensor it shares instead of a copy."""
    view = view_over(*ts)
    return view if view is not None else torch.cat(ts, dim=0)


def view_over(*ts: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose consecutive row blocks `ts` are, or None where they are not."""
    first = ts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in ts:
        same = t.dtype == first.dtype and t.device == first.device
        if not (same and t.shape[1:] == first.shape[1:] and t.is_contiguous()):
            return None
        if t.numel() == 0 or t.untyped_storage().data_ptr() != storage:
            return None
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.detach().as_strided(
        (rows, *first.shape[1:]), first.stride(), first.storage_offset()
    )
