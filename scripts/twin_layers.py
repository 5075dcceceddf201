"""scripts/selection_twin.py's budgets per layer: the --layer-budgets splits it tries, and the --layer-weights it
suggests from --ablate-layers (docs/ACCURACY.md, "Budgets per layer")."""
from __future__ import annotations


def parse_layer_budgets(specs: list[str], num_layers: int) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    """--layer-budgets "7=8192,18=4096:1696" -> [(((7, 8192), (18, 4096)), 1696)]: those layers' budgets, then every
    other layer's."""
    out = []
    for spec in specs:
        try:
            listed, rest = spec.split(":")
            pairs = tuple((int(layer), int(budget)) for layer, budget in (p.split("=") for p in listed.split(",")))
            rest = int(rest)
        except ValueError:
            raise SystemExit(f"error: --layer-budgets takes LAYER=BUDGET[,LAYER=BUDGET...]:OTHERS, not {spec!r}")
        if not all(0 <= layer < num_layers for layer, _ in pairs):
            raise SystemExit(f"error: --layer-budgets {spec!r} names a layer outside 0..{num_layers - 1}")
        out.append((pairs, rest))
    return out


def suggested_weights(cuts: dict[int, float], kl: float, share: float = 0.10, weight: float = 2.5) -> str:
    """From --ablate-layers: the layers whose dense attention cuts at least `share` of the rule's KL, largest cut
    first, as an engine --layer-weights value giving each `weight` (SmolLM2's five such layers at 2.5 get twice
    the budget; docs/ACCURACY.md, "Budgets per layer")."""
    heavy = sorted((layer for layer, cut in cuts.items() if kl > 0 and cut >= share * kl), key=lambda l: -cuts[l])
    if not heavy:
        return f"no layer cuts {share:.0%} of the KL alone: one budget in every layer"
    shares = ", ".join(f"{layer} ({cuts[layer] / kl:.0%})" for layer in heavy)
    return f"layers cutting >= {share:.0%} of the KL: {shares}; --layer-weights " + \
        ",".join(f"{layer}={weight:g}" for layer in sorted(heavy))
