"""Index expansion removed, as PopTorch's canonicalisation removes it.

Models often broadcast a one-dimensional index to the shape ``gather`` or
``scatter`` wants (``index.expand_as(src)``, ``index.expand(x.shape)``).  On
the IPU PopTorch does not materialise the expanded index: it lowers
``gather(data, d, index.expand(...))`` to a gather of whole slices along
``d`` (logging ``Optimising gather:``) and a scatter of whole slices the
same way (``Removing index expansion node:``).  The traced graph is
rewritten to the ATen operations of that meaning, so that the IR, the
engine and the estimate all hold it (no index of the data's size is made):

* ``gather(data, d, expand(i))`` -> ``index_select(data, d, i.view(-1))``;
* ``scatter_add(x, d, expand(i), src)`` and ``scatter_reduce(..., "sum",
  include_self=True)`` -> ``index_add(x, d, i.view(-1), src)``; with
  ``include_self=False`` the rows written are zeroed first
  (``index_fill``);
* ``scatter_reduce(x, d, expand(i), src, "prod" | "mean" | "amax" |
  "amin", include_self)`` -> ``index_reduce(x, d, i.view(-1), src, ...)``.

Each applies where ``i`` has one element along ``d`` per slice and size 1
along every other dimension, and the expanded index covers whole slices
(its other sizes are the data's, or ``src``'s and ``x``'s).  The values are
those of the original operations."""
import logging
import warnings

import torch

aten = torch.ops.aten
_log = logging.getLogger("poptorchsim")


def _meta(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _small_index(index, dim):
    """The one-dimensional index behind ``index`` if it is an expansion of a
    tensor with size 1 everywhere but ``dim``; else None."""
    if not isinstance(index, torch.fx.Node) or index.op != "call_function" \
            or index.target is not aten.expand.default:
        return None
    small = index.args[0]
    val = _meta(small)
    if not isinstance(val, torch.Tensor) or val.dim() != len(index.args[1]):
        return None
    if any(s != 1 for k, s in enumerate(val.shape) if k != dim):
        return None
    return small


def _flat(graph, node, small):
    """``small.view(-1)``, inserted before ``node``."""
    with graph.inserting_before(node):
        flat = graph.call_function(aten.view.default, (small, [-1]))
    val = _meta(small)
    flat.meta["val"] = val.reshape(-1)
    return flat


def _replace(node, target, args, kwargs=None):
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _dim(d, rank):
    return d + rank if d < 0 else d


def remove_index_expansions(gm):
    """Rewrites ``gm``'s gathers and scatters of expanded indices in place
    (see the module's text); returns how many."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.gather.default and not node.kwargs.get("sparse_grad"):
            data, d, index = node.args[:3]
            out = _meta(node)
            val = _meta(data)
            if out is None or val is None or not isinstance(d, int):
                continue
            d = _dim(d, val.dim())
            small = _small_index(index, d)
            if small is None or any(out.shape[k] != val.shape[k]
                                    for k in range(val.dim()) if k != d):
                continue
            _log.debug("Optimising gather: %s on an index expanded to %s", node.name,
                       list(out.shape))
            _replace(node, aten.index_select.default, (data, d, _flat(graph, node, small)))
            done += 1
        elif node.target in (aten.scatter_add.default, aten.scatter_reduce.two):
            x, d, index, src = node.args[:4]
            reduce = node.args[4] if len(node.args) > 4 else "sum"
            include_self = node.kwargs.get("include_self",
                                           node.args[5] if len(node.args) > 5 else True)
            xv, sv = _meta(x), _meta(src)
            if xv is None or sv is None or not isinstance(d, int):
                continue
            d = _dim(d, xv.dim())
            small = _small_index(index, d)
            if small is None or xv.dim() != sv.dim() or list(index.args[1]) != list(sv.shape) \
                    or any(sv.shape[k] != xv.shape[k] for k in range(xv.dim()) if k != d):
                continue
            _log.debug("Removing index expansion node: the index of %s (%s), expanded to %s",
                       node.name, reduce, list(sv.shape))
            flat = _flat(graph, node, small)
            if reduce == "sum":
                base = x
                if not include_self:
                    with graph.inserting_before(node):
                        base = graph.call_function(aten.index_fill.int_Scalar, (x, d, flat, 0))
                    base.meta["val"] = xv
                _replace(node, aten.index_add.default, (base, d, flat, src))
            else:
                # PyTorch warns once that index_reduce is "in beta": the user wrote a
                # scatter_reduce, so that warning would only puzzle them
                warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
                _replace(node, aten.index_reduce.default, (x, d, flat, src, reduce),
                         {"include_self": include_self})
            done += 1
    if done:
        graph.eliminate_dead_code()
        gm.recompile()
    return done
