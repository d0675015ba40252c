"""EAGLE-1 static tree choice lists (child-rank paths from the root)."""

# The 25-node tree the EAGLE-1 paper uses for 7B models ("mc_sim_7b_63").
MC_SIM_7B_63 = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]

STATIC_TREES = {"mc_sim_7b_63": MC_SIM_7B_63}


def coverage_choices(depth: int, top_k: int) -> list[list[int]]:
    """The tree a tree-score map is fitted on (evaluation/autotune.py `fit_tree_calibration`): a rank-0 spine `depth`
    nodes deep, every spine node (and the root) drafting all `top_k` ranks as children, depth x top_k nodes. Every
    (depth, rank) cell of a dynamic tree of node depth <= `depth` and top_k <= `top_k` gets one node per round, whose
    parent (the spine) is accepted as often as the head's best guesses are."""
    if depth < 1 or top_k < 1:
        raise ValueError(f"coverage tree {depth} x {top_k}: depth and top_k must be >= 1")
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(top_k)]


def static_choices(name_or_list) -> list[list[int]]:
    """Resolve a shipped tree name (or pass a choice list through)."""
    if isinstance(name_or_list, str):
        if name_or_list not in STATIC_TREES:
            raise ValueError(f"unknown static tree {name_or_list!r}; shipped: {sorted(STATIC_TREES)}")
        return STATIC_TREES[name_or_list]
    return [list(c) for c in name_or_list]
