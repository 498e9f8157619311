"""The engine's side of replica-grouped weights (``runtime/executor/replica_grouping.py``).

A grouped weight's device tensor holds a row per group of replicas.
``groups`` maps the index of each grouped parameter (in the step's
parameter order) to the row each replica computes with."""
import torch


def params_of(params, groups, r):
    """The parameters replica ``r`` computes with: its group's row of each
    grouped one (a view, so an update in place reaches the whole tensor)."""
    if not groups:
        return params
    return [p[groups[i][r]] if i in groups else p for i, p in enumerate(params)]


def spread(grads, params, groups, r):
    """Replica ``r``'s gradients, a grouped weight's put in its group's row
    of a whole-tensor gradient (zeros elsewhere): summed over replicas, each
    row then holds the sum over its group's replicas, as the IPU reduces a
    grouped weight's gradient within its group."""
    if not groups:
        return grads
    out = list(grads)
    for i, g in enumerate(grads):
        if i in groups:
            whole = torch.zeros(params[i].shape, dtype=g.dtype, device=g.device)
            whole[groups[i][r]] = g
            out[i] = whole
    return out


def grouped_update(run_update, state, acc, groups):
    """The optimizer update with grouped weights: each distinct combination
    of rows the replicas hold runs the update graph once, on those rows of
    the grouped weights, gradients and optimizer state; the other weights
    are updated by the first run (later runs take copies, so they are
    updated once).  Returns ``(params, opt_state, steps, factor)`` as
    ``Engine._run_update`` does, grouped rows written in place."""
    n_train = len(acc)
    grouped = {i: rows for i, rows in groups.items() if i < n_train}
    replicas = len(next(iter(groups.values())))
    combos = list(dict.fromkeys(tuple(rows[r] for rows in grouped.values())
                                for r in range(replicas)))
    params = state.params[:n_train]
    calls = []
    for c, combo in enumerate(combos):
        row = dict(zip(grouped, combo))

        def own(t, c=c):
            return t if c == 0 else t.clone()
        calls.append((row, (
            [p[row[i]] if i in row else own(p) for i, p in enumerate(params)],
            [a[row[i]] if i in row else own(a) for i, a in enumerate(acc)],
            [[s[row[i]] for s in slots] if i in row else [own(s) for s in slots]
             for i, slots in enumerate(state.opt_state)],
            [own(s) for s in state.steps])))
    first = None
    for row, call in calls:
        new_params, new_state, new_steps, factor = run_update(state, *call)
        for i, k in row.items():
            params[i][k].copy_(new_params[i])
            for slot, value in zip(state.opt_state[i], new_state[i]):
                slot[k].copy_(value)
        if first is None:
            first = (new_params, new_state, new_steps, factor)
    assert first is not None, "every weight has a row in some group"
    new_params, new_state, new_steps, factor = first
    return ([params[i] if i in grouped else p for i, p in enumerate(new_params)],
            [state.opt_state[i] if i in grouped else s for i, s in enumerate(new_state)],
            new_steps, factor)
