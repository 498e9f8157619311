"""PopTorch's ``module_repr`` and ``print``: a module's repr that also shows
its forward pre-hooks, where ``BeginBlock`` puts a model's blocks
(``BeginBlock(user_id=.., ipu_id=..) Linear(...)``)."""
import builtins

import torch


def module_repr(m):
    """``repr(m)`` with every submodule's forward pre-hooks written before
    its name, so the ``BeginBlock`` annotations of a model can be read."""
    extra = m.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    child_lines = []
    for key, module in m._modules.items():
        text = module_repr(module).replace("\n", "\n  ")
        child_lines.append(f"({key}): {text}")
    hooks = "".join(f"{hook!r} " for hook in m._forward_pre_hooks.values())
    text = hooks + m._get_name() + "("
    if len(extra_lines) == 1 and not child_lines:
        text += extra_lines[0]
    elif extra_lines or child_lines:
        text += "\n  " + "\n  ".join(extra_lines + child_lines) + "\n"
    return text + ")"


def print(m):  # PopTorch's name (it shadows the builtin in its namespace)
    """Prints ``module_repr(m)`` for a module, then ``m`` as the builtin does."""
    if isinstance(m, torch.nn.Module):
        builtins.print(module_repr(m))
    builtins.print(m)
