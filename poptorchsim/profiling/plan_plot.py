"""The planner's plot: estimated throughput against memory headroom."""
import textwrap


def plot_plan(result, path):
    """A PNG of ``result`` (a ``runtime.planning.plan_result.PlanResult``): one point
    per configuration (fitting ones filled, the rest crosses), the best one
    ringed, the configurations given to evaluate starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, style in ((False, dict(marker="x", color="#c0392b", label="does not fit")),
                        (True, dict(marker="o", color="#2471a3", label="fits"))):
        pts = [r for r in result.results if r.fits == fits and r.samples_per_second > 0]
        if pts:
            ax.scatter([100 * r.headroom for r in pts],
                       [r.samples_per_second for r in pts], **style)
    for r in (result.find(c) for c in result.included):
        if r is not None and r.samples_per_second > 0:
            ax.scatter([100 * r.headroom], [r.samples_per_second], marker="*", s=180,
                       facecolor="none", edgecolor="#1e8449", label="included (yours)")
    if result.best is not None:
        b = result.best
        ax.scatter([100 * b.headroom], [b.samples_per_second], marker="o", s=160,
                   facecolor="none", edgecolor="black", label="best")
        best = b.config.describe(result.repeated, result.units)
        fig.text(0.01, 0.01, textwrap.fill("best: " + best, 110),
                 fontsize=7, va="bottom")
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("memory headroom of the fullest tile (%)")
    ax.set_ylabel("estimated samples / s")
    ax.set_title(f"{len(result.results)} configurations on {result.ipus} {result.target_name} IPUs")
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
