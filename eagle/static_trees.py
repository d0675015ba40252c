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


def static_choices(name_or_list) -> list[list[int]]:
    """Resolve a shipped tree name (or pass a choice list through)."""
    if isinstance(name_or_list, str):
        if name_or_list not in STATIC_TREES:
            raise ValueError(f"unknown static tree {name_or_list!r}; shipped: {sorted(STATIC_TREES)}")
        return STATIC_TREES[name_or_list]
    return [list(c) for c in name_or_list]
