"""Splitting a model's layers over IPUs, shared by the planner
(``runtime/planning/planner.py``) and ``suggest_split`` (``runtime/planning/autosplit.py``):
the placement that measures every layer on its own, and the contiguous
partition of the layers that balances their cycles within the memory."""


class OneStagePerBlock:
    """A placement for measuring: every block its own stage, all on IPU 0
    (shaped as ``passes.stages.StagedSpec``)."""
    pipelined = False
    phased = False

    def assign(self, blocks, default=False):
        """Ops before the first block (``default``) are measured with it."""
        return {b: (i, 0) for i, (b, _) in enumerate(dict.fromkeys(blocks))}


MEMORY_BUDGET = 0.8     # share of an IPU's memory a group may fill (headroom for code)


def partition(costs, mems, n, capacity):
    """Contiguous groups minimising the slowest group's share of the cycles,
    with every group's memory within ``MEMORY_BUDGET`` of ``capacity``; where
    that cannot hold, the fullest group's memory is minimised instead."""
    k = len(costs)
    tc, tm = sum(costs) or 1.0, sum(mems) or 1
    pre_c, pre_m = [0.0], [0]
    for c, m in zip(costs, mems):
        pre_c.append(pre_c[-1] + c)
        pre_m.append(pre_m[-1] + m)

    budget = MEMORY_BUDGET * capacity

    def weight(i, j):
        mem = pre_m[j] - pre_m[i]
        if mem > budget:
            return 1.0 + mem / tm            # worse than any split that fits
        return (pre_c[j] - pre_c[i]) / tc

    inf = float("inf")
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for g in range(1, n + 1):
        for j in range(1, k + 1):
            for i in range(g - 1, j):
                v = max(best[g - 1][i], weight(i, j))
                if v < best[g][j]:
                    best[g][j], cut[g][j] = v, i
    groups, j = [], k
    for g in range(n, 0, -1):
        i = cut[g][j]
        groups.append(list(range(i, j)))
        j = i
    return groups[::-1]
