"""The tensors of a weight update: dtype names, and checking and loading them into a model.

Both sides use the dtype names (`dtype_from_name`, `dtype_name`: the strings of the HTTP
announcement); the engine checks an announcement against its model (`check_update`) before
anything is received, and loads received tensors by name (`load_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class WeightUpdateError(ValueError):
    """A weight update whose names, dtypes or shapes do not fit the model."""


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    if not isinstance(name, str):
        raise WeightUpdateError(f"dtype {name!r}: expected a string such as 'bfloat16'")
    key = name.removeprefix("torch.")
    found = _DTYPES.get(key, getattr(torch, key, None) if key.isidentifier() else None)
    if not isinstance(found, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r} (expected one of {sorted(_DTYPES)})")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every loadable tensor of `model` by name, tied aliases included (lm_head.weight...)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def check_update(
    model: torch.nn.Module,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str] | None = None,
) -> None:
    """Raise WeightUpdateError unless every name is a model tensor of the announced shape (and,
    given `dtypes`, of a dtype that loads into it: a floating-point weight takes only
    floating-point values; a cast between float widths is fine)."""
    targets = model_tensors(model)
    if len(names) != len(shapes) or (dtypes is not None and len(dtypes) != len(names)):
        raise WeightUpdateError(
            "names, dtypes and shapes differ in length "
            f"({len(names)}, {len(dtypes) if dtypes is not None else '-'}, {len(shapes)})"
        )
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if name not in targets:
            raise WeightUpdateError(f"unknown weight {name!r}")
        if tuple(targets[name].shape) != tuple(shape):
            raise WeightUpdateError(
                f"weight {name!r}: shape {list(shape)} does not match the model's "
                f"{list(targets[name].shape)}"
            )
        if dtypes is not None:
            dtype = dtype_from_name(dtypes[i])
            if dtype.is_floating_point != targets[name].dtype.is_floating_point:
                raise WeightUpdateError(
                    f"weight {name!r}: dtype {dtype_name(dtype)} cannot load into the model's "
                    f"{dtype_name(targets[name].dtype)}"
                )


@torch.no_grad()
def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each tensor into the model tensor of that name (cast to its dtype and device).

    Returns how many tensors were loaded. Check with `check_update` first where the tensors can
    still be refused without leaving the model half-updated.
    """
    targets = model_tensors(model)
    count = 0
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise WeightUpdateError(f"unknown weight {name!r}")
        if target.shape != tensor.shape:
            raise WeightUpdateError(
                f"weight {name!r}: shape {list(tensor.shape)} does not match the model's "
                f"{list(target.shape)}"
            )
        target.copy_(tensor)
        count += 1
    return count
