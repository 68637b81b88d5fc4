"""normlab.runner.experiments.demo.report: the sentences of the demo's report say what the numbers show."""

from normlab.runner.experiments.demo.report import _cost_section


def _cost(ms: dict[str, float]) -> dict:
    pws = ms["pws"]
    return {"width": 0.25, "repeats": 3, "iters": 5,
            "by_batch": {"2": {n: {"median_s": v / 1000, "ratio_to_pws": v / pws} for n, v in ms.items()}}}


def test_cost_claim_names_the_norms_pws_beats_and_those_it_does_not():
    text = "\n".join(_cost_section(_cost({"bn": 2.8, "gn": 2.9, "sn": 8.5, "pws": 5.3})))
    assert "Claim 4 at batch 2" in text and "**no**" in text
    assert "PWS's step is cheaper than sn (of bn, gn, sn)." in text
    assert "| sn | 8.50 | 1.60x |" in text


def test_cost_claim_yes_when_pws_is_cheapest():
    text = "\n".join(_cost_section(_cost({"bn": 6.0, "gn": 7.0, "pws": 5.0})))
    assert "**yes**" in text and "cheaper than bn, gn (of bn, gn)." in text
